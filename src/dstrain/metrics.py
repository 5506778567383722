"""What a run reports: throughput, FLOPs, MFU, memory, and the files that hold them.

FLOPs per token come from ``dstrain.model.config.flops_per_token`` (6N + 12·layers·d·seq:
forward + backward of the dense weights, plus attention scores); TFLOP/s per device is
that times tokens/s over the number of devices; tokens/s counts training time only (the
``IntervalClock`` pauses around evaluation and checkpoints). MFU divides by the device's
dense peak for the run's precision, looked up by device name and memory size in
``DEVICE_PEAKS`` (or set DSTRAIN_PEAK_TFLOPS), and is null where it is unknown.

torch and DeepSpeed are imported where a function measures a device, so that reading metrics.jsonl
(``read_records``, for ``dstrain compare`` and the plots) costs neither.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, TypedDict, cast

from tqdm import tqdm

from dstrain.errors import DISK_FULL_EXIT
from dstrain.run_dir import RunDir
from dstrain.strategy.precision import Precision


@dataclass(frozen=True)
class DevicePeak:
    """One accelerator variant: how its name reads, the memory that tells look-alike names apart, dense peaks."""

    variant: str
    name: str  # regular expression searched in the device name
    tflops: dict[str, float]  # precision -> dense TFLOP/s (vendor datasheet, without sparsity); fp32 = non-tensor FP32
    min_memory_gib: float = 0.0  # the variant has at least this much device memory (when the name is ambiguous)
    max_memory_gib: float = float("inf")


_H100_SXM = {"bf16": 989.5, "fp16": 989.5, "fp32": 67.0}
_H100_NVL = {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
# First match wins: specific variants before the names they contain. Device names as the driver reports them
# (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB").
DEVICE_PEAKS = (
    DevicePeak("GH200", r"GH200", _H100_SXM),
    DevicePeak("H200 NVL", r"H200.*NVL", _H100_NVL),
    DevicePeak("H200 SXM", r"H200", _H100_SXM),
    DevicePeak("H100 NVL", r"H100.*NVL", _H100_NVL),
    DevicePeak("H100 PCIe", r"H100.*PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.0}),
    DevicePeak("H100 SXM", r"H100.*(SXM|HBM3)", _H100_SXM),
    DevicePeak("H100 NVL", r"H100", _H100_NVL, min_memory_gib=88),  # 94 GB, whatever the name says
    DevicePeak("H800 PCIe", r"H800.*PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.0}),
    DevicePeak("H800 SXM", r"H800", _H100_SXM),
    DevicePeak("A100 40GB", r"A100", _A100, max_memory_gib=48),
    DevicePeak("A100 80GB", r"A100", _A100, min_memory_gib=48),
    DevicePeak("L40S", r"L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}),
    DevicePeak("L40", r"L40\b", {"bf16": 181.05, "fp16": 181.05, "fp32": 90.5}),
    DevicePeak("L4", r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    DevicePeak("A10", r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    DevicePeak("V100S", r"V100S", {"fp16": 130.0, "fp32": 16.4}),
    DevicePeak("V100 PCIe", r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    DevicePeak("V100 SXM2", r"V100", {"fp16": 125.0, "fp32": 15.7}),
    DevicePeak("MI300X", r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
)


def lookup_peak(name: str, memory_bytes: int, precision: Precision) -> tuple[str | None, float | None]:
    """(variant, dense TFLOP/s for ``precision``) of a device; (None, None) for a device not in DEVICE_PEAKS,
    or a name that does not tell its variant (an "H100" of 80 GB: SXM or PCIe)."""
    memory_gib = memory_bytes / 2**30
    for peak in DEVICE_PEAKS:
        if re.search(peak.name, name, re.IGNORECASE) and peak.min_memory_gib <= memory_gib < peak.max_memory_gib:
            return peak.variant, peak.tflops.get(precision)
    return None, None


def device_peak(precision: Precision) -> tuple[float | None, str]:
    """This rank's device: its dense peak for ``precision`` (DSTRAIN_PEAK_TFLOPS wins), and a line naming it."""
    if os.environ.get("DSTRAIN_PEAK_TFLOPS"):
        tflops = float(os.environ["DSTRAIN_PEAK_TFLOPS"])
        return tflops, f"MFU against {tflops:g} TFLOP/s per device (DSTRAIN_PEAK_TFLOPS)"
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    props = getattr(getattr(torch, accelerator.device_name(), None), "get_device_properties", None)
    if props is None:
        return None, f"MFU not logged: no known peak for {accelerator.device_name()} devices; set DSTRAIN_PEAK_TFLOPS"
    device = props(accelerator.current_device())
    variant, peak = lookup_peak(device.name, device.total_memory, precision)
    memory = f"{device.name}, {device.total_memory / 2**30:.0f} GiB"
    if peak is None:
        return None, f"MFU not logged: no known dense {precision} peak for {memory}; set DSTRAIN_PEAK_TFLOPS"
    return peak, f"MFU against {variant} dense {precision} peak {peak:g} TFLOP/s ({memory})"


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


class MetricsRecord(TypedDict, total=False):
    """One train or eval line of metrics.jsonl. A train record has no ``split``; an eval record's split is
    ``valid`` (the sources' weighted total) or ``valid/<source>``. MoE runs add ``moe_aux_loss``, ``moe_z_loss`` and
    ``moe_layer<i>_share_{min,max,entropy}`` (keys a TypedDict cannot name)."""

    step: Required[int]
    loss: Required[float]
    split: str  # eval records only
    ppl: float  # eval
    samples: int  # eval: the samples evaluated
    duration_s: float  # eval: the total ("valid") record only
    consumed_samples: int
    consumed_tokens: int
    lr: float
    grad_norm: float | None  # pre-clip, fp32; None where the engine does not compute it
    loss_scale: float | None  # fp16 only
    skipped_steps: int
    learned_tokens: float  # per step (mean over the logged interval): the global batch's tokens with a label, the
    # loss's divisor (all of them for text; a --chat sample's assistant tokens)
    tokens_per_s: float  # over all ranks, training time only: every token processed, learned or not
    tflops_per_device: float
    mfu: float | None  # None where the device's peak is unknown
    mem_peak_bytes: int  # the largest of all ranks
    elapsed_s: float
    train_s: float  # the logging interval's seconds (IntervalClock.lap)
    eval_s: float
    checkpoint_s: float
    moe_aux_loss: float
    moe_z_loss: float


class EventRecord(TypedDict, total=False):
    """One event line of metrics.jsonl: a resume (``tag``, ``changed``), a loss spike rolled back, a run stopped
    by an error (``message``), the previous launch's hang (logged by the launch after it), or a relaunch of
    slurm/train.sbatch after a failed step (restart, spare, shrink, requeue: dstrain.train.elastic)."""

    step: Required[int]
    # "resume" | "spike" | "disk_full" | "stopped" | "hang" | "restart" | "spare" | "shrink" | "requeue"
    event: Required[str]
    message: str  # disk_full, stopped: the error's line
    hang_step: int  # hang: the step the watchdog found stalled
    at: str  # hang: where in it (e.g. "backward 0 of step 5")
    detail: str  # hang: the watchdog's line, naming the stalled ranks
    tag: str  # resume: the checkpoint tag resumed from
    changed: dict  # resume: recipe key -> [old, new]
    spike_step: int  # spike
    metric: str  # spike: what the guard watched
    value: float  # spike: the value that tripped it
    median: float  # spike: the median of the guard's window
    threshold: float  # spike: factor x median
    rolled_back_to: str | None  # spike: the tag reloaded; None before the first checkpoint
    skipped_samples: list[int] | None  # spike: [first, end) of the samples skipped on the way back


@dataclass(frozen=True)
class SourceLoss:
    """One data source's evaluation: the token-weighted mean loss of its first ``samples`` samples."""

    name: str
    weight: float  # its data.sources weight
    loss: float
    samples: int


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged run's loss would overflow it


def evaluation_summary(sources: list[SourceLoss]) -> dict:
    """The evaluation of all sources, as the trainer's ``valid`` record and ``dstrain eval`` both give it: the
    sources' losses averaged by their data.sources weights, and the samples evaluated."""
    loss = sum(s.weight * s.loss for s in sources) / sum(s.weight for s in sources)
    return {"loss": loss, "ppl": perplexity(loss), "samples": sum(s.samples for s in sources)}


def _parse(line: str) -> dict | None:
    """A metrics.jsonl line, or None for one cut short by a killed job."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


def _read(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [record for line in metrics.read_text().splitlines() if (record := _parse(line)) is not None]


def read_records(metrics: Path) -> list[MetricsRecord]:
    """The train and eval records of ``metrics`` (a missing file has none); event records and lines cut short
    by a killed job are skipped."""
    return cast("list[MetricsRecord]", [r for r in _read(metrics) if "event" not in r])


def read_events(metrics: Path) -> list[EventRecord]:
    """The event records of ``metrics`` (a resume, a rolled-back spike)."""
    return cast("list[EventRecord]", [r for r in _read(metrics) if "event" in r])


def drop_records_after(metrics: Path, step: int) -> None:
    """Keep only the records up to ``step`` (a resume or a rollback logs the later steps again), atomically."""
    if not metrics.exists():
        return
    kept = [line for line in metrics.read_text().splitlines() if _logged_step(line) <= step]
    tmp = metrics.with_name("metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, metrics)


def _logged_step(line: str) -> float:
    """The step of a metrics line; a line cut short by a killed job counts as after any checkpoint."""
    record = _parse(line)
    return float("inf") if record is None else record["step"]


def realised_mix(record: Mapping[str, Any]) -> dict[str, float]:
    """Each source's share of a logged interval's samples (``mix_<source>``, logged when the data blends sources)."""
    return {key.removeprefix("mix_"): float(value) for key, value in record.items() if key.startswith("mix_")}


def task_names(record: Mapping[str, Any]) -> list[str]:
    """The downstream tasks an eval record holds (``task/<name>/acc``), in logged order."""
    return [key.split("/")[1] for key in record if key.startswith("task/") and key.endswith("/acc")]


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

            # what a resumed run kept (run.claim_run_dir cut it at the checkpoint)
            self.monitors = open_monitors(files, _read(files.metrics))

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
