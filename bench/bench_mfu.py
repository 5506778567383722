"""MFU of the cluster recipes on this node: one command, one table.

    .venv/bin/python bench/bench_mfu.py [--recipes gpt2-125m gpt-1.3b] [--nproc N] [--steps 30]

Each recipe runs through `dstrain compare` (the deepspeed launcher, every local device by default)
under the ds_config it is meant for, on the demo's corpus (prepared first if missing: tokens are
tokens for throughput), with a global batch cut so that a step takes about a second on an H100.
MFU is the trainer's own: the median over logged steps after the first of 6N + 12·L·d·seq FLOPs per
token × tokens/s per device ÷ the device's dense peak (src/dstrain/metrics.py; DSTRAIN_PEAK_TFLOPS
overrides it). The targets and the settings behind them are in BENCHMARKS.md, "GPU readiness".
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from gpu_check import ensure_data  # noqa: E402

DATA = ROOT / "data" / "pydocs"
# recipe: (ds_config, overrides that shorten a step, MFU target in % on H100 or None)
PLAN = {
    "tiny": ("zero1.json", [], None),  # a CPU smoke run of this script
    "gpt2-125m": ("zero1_bf16.json", ["train.global_batch=32"], 40),
    "gpt2-350m": ("zero1_bf16.json", ["train.global_batch=32"], 45),
    "gpt-1.3b": ("zero1_bf16.json", ["train.global_batch=16"], 50),
    "llama-7b": ("zero3_bf16.json", ["train.global_batch=16"], 45),
}


def run(recipe: str, nproc: int | None, steps: int, out: Path) -> dict:
    config, shorten, _ = PLAN[recipe]
    command = [
        sys.executable,
        "-m",
        "dstrain",
        "compare",
        "--recipe",
        str(ROOT / "recipes" / f"{recipe}.yaml"),
        "--deepspeed_configs",
        str(ROOT / "ds_configs" / config),
        "--steps",
        str(steps),
        "--out",
        str(out),
        *(["--nproc", str(nproc)] if nproc else []),
        f"data.sources=[{{path: {DATA}}}]",
        "train.eval_interval=1000000",
        "train.checkpoint_interval=1000000",
        "train.eval_samples=64",
        "schedule.warmup_steps=1",
        *shorten,
    ]
    subprocess.run(command, check=False)  # a failed config still has its row and reason
    if not (out / "results.csv").exists():  # refused before running: compare printed why
        return {
            "config": Path(config).stem,
            "world_size": "",
            "tokens_per_s": "",
            "tflops_per_device": "",
            "mfu": "",
            "status": "not run",
            "reason": "(see the error above)",
        }
    with (out / "results.csv").open(newline="") as f:
        return next(csv.DictReader(f))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["gpt2-125m", "gpt-1.3b"], choices=sorted(PLAN))
    parser.add_argument("--nproc", type=int, default=None, help="ranks per run (default: every local device)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / f"bench-mfu-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    ensure_data(DATA, dict(os.environ))  # bench/gpu_check.py's: the demo corpus, prepared if missing
    rows = [(recipe, run(recipe, args.nproc, args.steps, args.out / recipe)) for recipe in args.recipes]
    print(
        f"\n{'recipe':<10} {'ds_config':<16} {'ranks':>5} {'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>6} "
        f"{'target':>6}  status"
    )
    for recipe, row in rows:
        mfu = f"{float(row['mfu']):.0%}" if row["mfu"] else "n/a"
        target = f"{PLAN[recipe][2]}%" if PLAN[recipe][2] else "-"
        rate = f"{float(row['tokens_per_s']):,.0f}" if row["tokens_per_s"] else "-"
        tflops = f"{float(row['tflops_per_device']):.3g}" if row["tflops_per_device"] else "-"
        print(
            f"{recipe:<10} {row['config']:<16} {row['world_size']:>5} {rate:>10} {tflops:>11} {mfu:>6} {target:>6}  "
            f"{row['status']} {row['reason']}".rstrip()
        )
    print(
        f"\nreports: {args.out}/<recipe>/report.md"
        + (
            ""
            if any(r["mfu"] for _, r in rows)
            else "\nMFU n/a: no known peak for this device; set DSTRAIN_PEAK_TFLOPS to its dense peak"
        )
    )
    return 0 if all(row["status"] == "completed" for _, row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
