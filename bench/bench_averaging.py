"""The weight averages' valid loss against the live weights' on the tiny recipe with the wsd schedule.

One run of recipes/tiny.yaml (schedule.kind=wsd: warmup, a stable lr, then a linear decay over the last
decay_fraction of the steps) as one process under ds_configs/zero0.json, with train.averaging keeping an EMA and a
last-N merge, evaluated every --eval-interval steps. Printed: per eval, the live weights' valid loss (split valid),
the EMA's and the last-N mean's (valid/averaged/ema, valid/averaged/last_n), their differences, and the phase.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_averaging.py --data data/pydocs [--steps 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(args: argparse.Namespace, run_dir: Path) -> list[dict]:
    command = [
        *(sys.executable, "-m", "dstrain.train", "--recipe", str(ROOT / "recipes" / "tiny.yaml")),
        *("--deepspeed_config", str(ROOT / "ds_configs" / "zero0.json")),
        *(f"data.sources=[{{path: {args.data}}}]", f"train.steps={args.steps}", "schedule.kind=wsd"),
        *(f"schedule.decay_fraction={args.decay_fraction}", f"train.eval_interval={args.eval_interval}"),
        *("train.checkpoint_interval=0", f"run_dir={run_dir}"),
        f"train.averaging.ema_half_life_tokens={args.ema_half_life_tokens}",
        *(f"train.averaging.last_n={args.last_n}", f"train.averaging.last_n_every={args.last_n_every}"),
        f"train.averaging.start_step={args.start_step}",
    ]
    from dstrain.train.process.distributed import free_port

    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    if not (run_dir / "summary.json").is_file():  # a finished run in --out is read again, not repeated
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if str(r.get("split", "")).startswith("valid")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/pydocs", help="the prepared corpus (tiny.yaml's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--decay-fraction", type=float, default=0.2)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--ema-half-life-tokens", type=int, default=40960, help="default: 20 steps of 2048 tokens")
    parser.add_argument("--last-n", type=int, default=8)
    parser.add_argument("--last-n-every", type=int, default=5)
    parser.add_argument("--start-step", type=int, default=20, help="default: the warmup's 20 steps left out")
    parser.add_argument("--out", default=None, help="keep the run here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dstrain-bench-averaging-") as tmp:
        records = train(args, Path(args.out or tmp) / "run")
    decay_start = args.steps - round(args.steps * args.decay_fraction)
    by_step: dict[int, dict[str, float]] = {}
    for r in records:
        by_step.setdefault(r["step"], {})[r["split"]] = r["loss"]
    print(f"tiny, wsd (decay from step {decay_start + 1}), EMA half-life {args.ema_half_life_tokens} tokens, last-N "
          f"{args.last_n} every {args.last_n_every} steps, from step {args.start_step + 1}")  # fmt: skip
    print("| step | phase | live | EMA | EMA - live | last-N | last-N - live |")
    print("|---|---|---|---|---|---|---|")
    for step, losses in sorted(by_step.items()):
        live, ema, last = (losses.get(k) for k in ("valid", "valid/averaged/ema", "valid/averaged/last_n"))
        phase = "decay" if step > decay_start else "warmup" if step <= 20 else "stable"
        cells = [f"{v:.4f}" if v is not None else "-" for v in (live, ema)]
        cells.append(f"{ema - live:+.4f}" if ema is not None and live is not None else "-")
        cells.append(f"{last:.4f}" if last is not None else "-")
        cells.append(f"{last - live:+.4f}" if last is not None and live is not None else "-")
        print(f"| {step} | {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
