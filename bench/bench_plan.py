"""The planner's predicted step time beside the measured one, for one layout of every kind on this machine.

``dstrain compare --plan K`` runs the K fastest layouts, which on 2 CPU ranks are all ZeRO-0 or ZeRO-1 with or
without SP: it never checks a ZeRO-3, offloaded, pipelined or tensor-parallel prediction. This bench calibrates
this machine as ``--plan`` does (the bare model, a gloo all-reduce, DeepSpeed's engines, a TP and an SP group),
takes the planner's fastest layout of each kind in KINDS and runs them the way ``--plan`` does (interleaved, three
stretches each), then prints the same table, fastest predicted first: predicted and measured seconds per step,
their ratio, each run's spread. The calibration times a few steps per kind: run it on an otherwise idle machine.

    .venv/bin/python bench/bench_plan.py --out runs/bench-plan-tiny
    .venv/bin/python bench/bench_plan.py --out runs/bench-plan-gpt2 model.flavour=gpt2 model.n_kv_head=4 \\
        model.d_model=256 data.seq_len=256 train.global_batch=8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One per distinct engine and collective pattern (Layout.describe() without the micro-batch).
KINDS = (
    "ZeRO-0",
    "ZeRO-1",
    "ZeRO-2",
    "ZeRO-3",
    "ZeRO-2 offload optimizer",
    "ZeRO-3 offload optimizer+params",
    "ZeRO-0 act-ckpt",
    "ZeRO-1 TP2",
    "ZeRO-1 PP2",
    "ZeRO-1 PP2 DualPipeV",
    "ZeRO-0 SP2",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes/tiny.yaml"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.commands.calibrate_engine import with_engine_costs
    from dstrain.commands.compare import check_configs, check_fresh, run_interleaved, run_overrides
    from dstrain.commands.compare_plan import prediction_lines, write_configs
    from dstrain.plan.calibrate import calibrated_device
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import Cluster

    overrides = run_overrides(["schedule.warmup_steps=2", "train.eval_samples=16", *args.overrides], args.steps)
    recipe = load_recipe_and_source(args.recipe, overrides)[0]
    start = time.perf_counter()
    cluster = Cluster(with_engine_costs(recipe, calibrated_device(recipe, args.nproc), args.nproc), 1, args.nproc)
    print(f"calibrated in {time.perf_counter() - start:.0f} s: {cluster.device}", flush=True)
    every, _ = plan(recipe, cluster, "fp32", 10**6, torch_adam=True)
    fastest = {}
    for planned in every:  # fastest first
        fastest.setdefault(planned.layout.describe(), planned)
    kept = sorted((fastest[kind] for kind in KINDS if kind in fastest), key=lambda p: p.prediction.step_s)
    print("not planned here:", [kind for kind in KINDS if kind not in fastest])
    configs, predicted = write_configs(kept, args.out)
    entries = [(Path(c).stem, c, []) for c in configs]
    check_fresh(args.out, entries)
    check_configs(args.recipe, entries, overrides, args.nproc)
    run_interleaved(args.recipe, entries, args.out, args.nproc, overrides, recipe.total_steps)
    table = prediction_lines(args.out, predicted, recipe.train.global_batch * recipe.data.seq_len)
    (args.out / "prediction.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
