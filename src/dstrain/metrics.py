"""What a run reports while it trains: throughput, FLOPs, MFU, memory, written to metrics.jsonl and the console.

FLOPs per token come from ``dstrain.model.counts.flops_per_token`` (6N + 12·layers·d·seq:
forward + backward of the dense weights, plus attention scores); TFLOP/s per device is
that times tokens/s over the number of devices; tokens/s counts training time only (the
``IntervalClock`` pauses around evaluation and checkpoints). MFU divides by the device's
dense peak for the run's precision, looked up by device name and memory size in
``dstrain.devices.DEVICE_PEAKS`` (or set DSTRAIN_PEAK_TFLOPS), and is null where it is unknown.

The records' schema and reader are ``dstrain.metrics_records``; torch and DeepSpeed are imported where a function
measures a device.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dstrain.errors import DISK_FULL_EXIT
from dstrain.metrics_records import drop_records_after, read_all, task_names
from dstrain.run_dir import RunDir


class IntervalClock:
    """Seconds of one logging interval, split into training and the pauses around evaluation and checkpoints.

    Throughput (tokens/s, TFLOP/s, MFU) counts ``train_s`` only, as Megatron-LM does; the pauses are logged apart.
    """

    KINDS = ("eval", "checkpoint")

    def __init__(self, now=time.perf_counter):
        self.now = now
        self.start = now()
        self.pauses = dict.fromkeys(self.KINDS, 0.0)

    @contextlib.contextmanager
    def paused(self, kind: str):
        start = self.now()
        try:
            yield
        finally:
            self.pauses[kind] += self.now() - start

    def lap(self) -> dict:
        """The interval since the previous lap: ``train_s``, ``eval_s``, ``checkpoint_s``; starts the next one."""
        now = self.now()
        record = {
            "train_s": now - self.start - sum(self.pauses.values()),
            **{f"{kind}_s": seconds for kind, seconds in self.pauses.items()},
        }
        self.start, self.pauses = now, dict.fromkeys(self.KINDS, 0.0)
        return record


def peak_memory_bytes() -> int:
    """Peak memory of this rank's device since start (process RSS on CPU)."""
    from deepspeed.accelerator import get_accelerator

    return int(get_accelerator().max_memory_allocated())


def largest_peak_memory_of_all_ranks(device) -> int:
    """A collective: the highest peak over all ranks, the one that decides whether a config fits."""
    import torch

    peak = torch.tensor([float(peak_memory_bytes())], device=device, dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return int(peak.item())


def task_parts(record: Mapping[str, Any]) -> list[str]:
    """The console's words for an eval record's tasks: ``hellaswag acc 0.312 norm 0.344``, then their time."""
    parts = []
    for name in task_names(record):
        norm = record.get(f"task/{name}/acc_norm")
        parts.append(f"{name} acc {record[f'task/{name}/acc']:.3f}" + ("" if norm is None else f" norm {norm:.3f}"))
    return parts + ([f"tasks {record['tasks_s']:.1f}s"] if "tasks_s" in record else [])


class MetricsLog:
    """metrics.jsonl (one object per log or eval) plus rank 0's console line; other ranks write nothing. Every
    record also goes to the monitors the run's ds_config enables (W&B, TensorBoard, CSV: dstrain.monitors)."""

    def __init__(self, files: RunDir, enabled: bool, total_steps: int, monitor=None):
        """``monitor``: DeepSpeed's MonitorMaster (engine.monitor); only a block dstrain does not write itself (comet)
        can enable it."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.start = time.time()
        self.file = files.metrics.open("a") if enabled else None
        self.monitors = None
        if enabled:
            from dstrain.monitors import open_monitors

            # what a resumed run kept (run_folder.claim_run_dir cut it at the checkpoint)
            self.monitors = open_monitors(files, read_all(files.metrics))

    def write(self, record: dict) -> None:
        if self.file is None:  # not rank 0
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.monitors is not None:
            self.monitors.write(record)
        if self.monitor is not None and "event" not in record:
            from dstrain.monitors.records import scalars

            self.monitor.write_events([(name, value, record["step"]) for name, value in scalars(record).items()])

    def print_step(self, record: dict, start_step: int) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        bar = tqdm.format_meter(
            record["step"] - start_step, self.total_steps - start_step, elapsed, ncols=70, unit="step"
        )
        parts = [f"step {record['step']}/{self.total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        if record.get("loss_scale") is not None:
            parts.append(f"scale {record['loss_scale']:g} skipped {record['skipped_steps']}")
        print(" | ".join(parts) + " | " + bar, flush=True)

    def print_eval(self, record: dict) -> None:
        if self.enabled:
            line = f"eval step {record['step']} | {record['split']} loss {record['loss']:.4f} | ppl {record['ppl']:.2f}"
            print(line + "".join(f" | {part}" for part in task_parts(record)), flush=True)

    def note(self, line: str) -> None:
        """An event's console line (rank 0)."""
        if self.enabled:
            print(line, flush=True)

    def drop_after(self, step: int) -> None:
        """A rollback: the records after ``step`` belong to a discarded stretch of training."""
        if self.file is None:
            return
        path = Path(self.file.name)
        self.file.close()
        drop_records_after(path, step)
        self.file = path.open("a")
        if self.monitors is not None:
            self.monitors.drop_after(step)

    def stopped(self, step: int, error: Exception, exit_code: int) -> None:
        """A run stopped by an error every rank raised (a full disk, too many fp16 overflows, a loss that is not
        finite, too many rollbacks): its event, to the monitors first (the disk may be the full one), which close
        with the run marked failed."""
        if self.file is None:
            return
        record = {
            "step": step,
            "event": "disk_full" if exit_code == DISK_FULL_EXIT else "stopped",
            "message": str(error),
        }
        if self.monitors is not None:
            self.monitors.write(record)
            self.monitors.close(exit_code)
            self.monitors = None
        with contextlib.suppress(OSError):
            self.write(record)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.monitors is not None:
            self.monitors.close()


def peak_tensor_bytes(fn, device_type: str) -> int:
    """The most bytes of tensors alive at once on ``device_type`` while ``fn()`` runs, counted from the allocator's
    events by torch's memory profiler (allocations before the call are not counted; works on a CPU, which keeps no
    allocator statistics). Slow: for measurements, not for training."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device_type)
    return max((sum(categories) for categories in sizes), default=0)
