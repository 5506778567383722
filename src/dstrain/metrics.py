"""What a run reports: throughput, FLOPs, MFU, memory, and the files that hold them.

FLOPs per token come from ``dstrain.model.gpt.flops_per_token`` (6N + 12·layers·d·seq:
forward + backward of the dense weights, plus attention scores); TFLOP/s per device is
that times tokens/s over the number of devices; MFU divides by the device's peak, which
is known for common accelerators (or set DSTRAIN_PEAK_TFLOPS) and null elsewhere.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator
from tqdm import tqdm

# Dense peak TFLOP/s per device, by precision, from the vendors' datasheets (without sparsity).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def device_peak_tflops(precision: str) -> float | None:
    if os.environ.get("DSTRAIN_PEAK_TFLOPS"):
        return float(os.environ["DSTRAIN_PEAK_TFLOPS"])
    module = getattr(torch, get_accelerator().device_name(), None)
    props = getattr(module, "get_device_properties", None)
    if props is None:
        return None
    name = props(get_accelerator().current_device()).name
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def peak_memory_bytes() -> int:
    """Peak memory of this rank's device since start (process RSS on CPU)."""
    return int(get_accelerator().max_memory_allocated())


class MetricsLog:
    """metrics.jsonl (one object per log or eval) plus rank 0's console line; other ranks write nothing."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, monitor=None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.start = time.time()
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.monitor is not None:  # DeepSpeed's TensorBoard / CSV / W&B writers, when the ds_config enables them
            step = record["step"]
            prefix = "eval" if "split" in record else "train"
            events = [(f"{prefix}/{k}", v, step) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"]
            self.monitor.write_events(events)

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
            print(f"eval step {record['step']} | {record['split']} loss {record['loss']:.4f} | ppl {record['ppl']:.2f}", flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
