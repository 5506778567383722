"""`python -m dstrain.train` for bench/gpu_check.py's measurements, without the final checkpoint.

A measurement reads metrics.jsonl and deletes the run folder; the final checkpoint it would write first is 18 GB
for gpt-1.3b (about 20 s of a 7-minute loan, per run). Everything else is the trainer as users run it.

With GPU_TRAIN_PROFILE=OUT.json (and GPU_TRAIN_PROFILE_FROM=step, default 6) torch.profiler records three optimizer
steps after the warm-up and OUT.json says where their time went: the kernels that took the most device time, how
many kernels were launched, and the wall time the device spent outside kernels.

A dry run (CPU, toy sizes) starts its runs with ``run_forked``: forked from a process that imported torch, DeepSpeed
and the trainer once, instead of a new interpreter that spends ~7 of a run's ~10 s of CPU importing them. A GPU run
is a process of its own (its own peak memory; an OOM costs only that run).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
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


def main(argv: list[str]) -> int:
    from dstrain.train import run
    from dstrain.train.loop import Trainer

    Trainer.save = lambda self, background=False: None  # type: ignore[method-assign]
    profile_out = os.environ.get("GPU_TRAIN_PROFILE")
    hooks = ProfileSteps(Path(profile_out), int(os.environ.get("GPU_TRAIN_PROFILE_FROM", "6"))) if profile_out else None
    return run.main(argv, hooks)


# What every run imports; forking after them is what tests/ranks.py does for the test suite's ranks.
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "dstrain.train.run", "dstrain.train.loop", "gpu_train"]
_context = None


def _forked(argv: list[str], env: dict, log: str) -> None:
    """In the forked process: the run's environment, its output into ``log``, then ``main``'s status as its exit."""
    os.environ.clear()
    os.environ.update(env)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_forked(argv: list[str], env: dict) -> tuple[int, str]:
    """``main(argv)`` in a process forked from the preloaded server, with ``env`` as its environment: its exit status
    and what it printed (stdout and stderr, interleaved)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    with tempfile.NamedTemporaryFile("r", prefix="gpu-train-", suffix=".log") as log:
        process = _context.Process(target=_forked, args=(argv, env, log.name))
        process.start()
        process.join()
        return process.exitcode, Path(log.name).read_text(errors="replace")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
