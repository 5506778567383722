"""`python -m dstrain.train` for bench/gpu_check.py's measurements, without the final checkpoint.

A measurement reads metrics.jsonl and deletes the run folder; the final checkpoint it would write first is 18 GB
for gpt-1.3b (about 20 s of a 7-minute loan, per run). Everything else is the trainer as users run it.

With GPU_TRAIN_PROFILE=OUT.json (and GPU_TRAIN_PROFILE_FROM=step, default 6) torch.profiler records three optimizer
steps after the warm-up and OUT.json says where their time went: the kernels that took the most device time, how
many kernels were launched, and the wall time the device spent outside kernels.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dstrain.train.step.step_hooks import StepHooks

PROFILED_STEPS, TOP_KERNELS = 3, 15
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")  # as the profiler names them


class ProfileSteps(StepHooks):
    """Profiles optimizer steps first .. first + PROFILED_STEPS - 1 through the trainer's public step seam."""

    def __init__(self, out: Path, first: int) -> None:
        self.out, self.first, self.profiler, self.started = out, first, None, 0.0

    def stepped(self, step: int) -> None:
        import torch
        from deepspeed.accelerator import get_accelerator
        from torch.profiler import ProfilerActivity, profile

        if step == self.first - 1:
            gpu = get_accelerator().device_name() == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            get_accelerator().synchronize()
            self.profiler = profile(activities=activities)
            self.profiler.start()
            self.started = time.perf_counter()
        elif step == self.first + PROFILED_STEPS - 1 and self.profiler is not None:
            get_accelerator().synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.stop()
            self.out.write_text(json.dumps(summary(self.profiler, wall, torch.cuda.is_available()), indent=1) + "\n")


def summary(profiler, wall_s: float, gpu: bool) -> dict:
    """Per step: wall time, device time in kernels, launches; the top kernels (or CPU ops, on a CPU) by self time."""
    events = profiler.key_averages()
    if gpu:
        timed = [e for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
        busy_us = sum(e.self_device_time_total for e in timed)
    else:  # the dry run: the same code path over CPU ops
        timed = [e for e in events if e.self_cpu_time_total > 0]
        busy_us = sum(e.self_cpu_time_total for e in timed)

    def self_us(e) -> float:
        return e.self_device_time_total if gpu else e.self_cpu_time_total

    top = sorted(timed, key=self_us, reverse=True)[:TOP_KERNELS]
    per_step_ms, busy_ms = wall_s * 1e3 / PROFILED_STEPS, busy_us / 1e3 / PROFILED_STEPS
    return {
        "steps": PROFILED_STEPS,
        "wall_ms_per_step": round(per_step_ms, 2),
        "kernel_ms_per_step": round(busy_ms, 2),
        "outside_kernels_ms_per_step": round(max(per_step_ms - busy_ms, 0.0), 2),
        "launches_per_step": sum(e.count for e in events if e.key in LAUNCH_CALLS) // PROFILED_STEPS,
        "top": [
            {
                "kernel": e.key[:120],
                "count": e.count,
                "ms": round(self_us(e) / 1e3 / PROFILED_STEPS, 3),
                "share": round(self_us(e) / busy_us, 4),
            }
            for e in top
        ],
    }


if __name__ == "__main__":
    from dstrain.train import run
    from dstrain.train.loop import Trainer

    Trainer.save = lambda self, background=False: None  # type: ignore[method-assign]
    profile_out = os.environ.get("GPU_TRAIN_PROFILE")
    hooks = ProfileSteps(Path(profile_out), int(os.environ.get("GPU_TRAIN_PROFILE_FROM", "6"))) if profile_out else None
    sys.exit(run.main(sys.argv[1:], hooks))
