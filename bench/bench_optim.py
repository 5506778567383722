"""AdamW against Muon on the tiny recipe: steps to a target loss over several seeds, and the cost of a step.

Each seed trains the tiny recipe twice, AdamW then Muon (interleaved, so that load from other processes hits both
alike), as one process under ds_configs/zero0.json. Reported per optimizer: the
first step at which the mean training loss of the last WINDOW steps is at or below --target (median and range over
the seeds), the final loss, and the median step time over the logged steps after the first 10 (compilation of
Muon's kernels included in neither). Then the optimizer step alone on the tiny model's parameters: DeepSpeed's
MuonWithAuxAdam (eager, as dstrain runs it on a CPU) against torch's AdamW, alternating, median of --repeats.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_optim.py --data data/pydocs [--seeds 1 2 3] [--target 5.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 10
OPTIMIZERS = {"adamw": ["optim.kind=adamw"], "muon": ["optim.kind=muon"]}


def train(data: str, seed: int, overrides: list[str], steps: int, run_dir: Path) -> list[dict]:
    command = [
        *(sys.executable, "-m", "dstrain.train", "--recipe", str(ROOT / "recipes" / "tiny.yaml")),
        *("--deepspeed_config", str(ROOT / "ds_configs" / "zero0.json")),
        *(f"data.sources=[{{path: {data}}}]", f"seed={seed}", f"train.steps={steps}", "train.log_interval=1"),
        *("train.checkpoint_interval=0", "train.eval_interval=0", f"run_dir={run_dir}", *overrides),
    ]
    from dstrain.train.process.distributed import free_port

    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    if not (run_dir / "summary.json").is_file():  # a finished run in --out is read again, not repeated
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "split" not in r and "event" not in r]


def steps_to(records: list[dict], target: float) -> int | None:
    losses = [r["loss"] for r in records]
    for end in range(WINDOW, len(losses) + 1):
        if statistics.fmean(losses[end - WINDOW : end]) <= target:
            return records[end - 1]["step"]
    return None


def step_seconds(records: list[dict]) -> float:
    tokens = [r["consumed_tokens"] for r in records]
    rates = [r["tokens_per_s"] for r in records[10:] if r.get("tokens_per_s")]
    per_step = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else 0
    return per_step / statistics.median(rates)


def optimizer_step_ms(repeats: int) -> dict[str, float]:
    """Median ms of one optimizer step on the tiny model's parameters (random gradients), the two alternating."""
    import time

    import torch
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.gpt import GPT

    recipe = load_recipe_and_source(
        ROOT / "recipes" / "tiny.yaml", ["model.vocab_size=4096", "data.sources=[{path: none}]"]
    )[0]
    model = GPT(recipe.model)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    hidden = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = MuonWithAuxAdam(
        [{"params": hidden, "use_muon": True, "lr": 0.02}, {"params": rest, "use_muon": False, "lr": 3e-3}],
        adam_optimizer=torch.optim.AdamW,
    )
    optimizers = {"adamw": torch.optim.AdamW(model.parameters(), lr=3e-3), "muon": muon}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        for _ in range(repeats):
            for name, optimizer in optimizers.items():
                start = time.perf_counter()
                optimizer.step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) * 1000 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a `dstrain prepare` folder (the demo's data/pydocs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", type=float, default=5.0, help="mean training loss over the last 10 steps")
    parser.add_argument("--out", type=Path, default=None, help="keep the run folders here (default: a temp folder)")
    parser.add_argument("--repeats", type=int, default=30, help="optimizer steps timed per optimizer")
    parser.add_argument("--step-only", action="store_true", help="time the optimizer step alone, train nothing")
    args = parser.parse_args()
    step_ms = optimizer_step_ms(args.repeats)
    print(
        f"optimizer step alone (tiny, median of {args.repeats}): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in step_ms.items())
    )
    if args.step_only:
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_optim_"))
    results: dict[str, list[tuple[int | None, float, float]]] = {name: [] for name in OPTIMIZERS}
    for seed in args.seeds:
        for name, overrides in OPTIMIZERS.items():
            records = train(args.data, seed, overrides, args.steps, out / f"{name}_seed{seed}")
            reached = steps_to(records, args.target)
            results[name].append((reached, records[-1]["loss"], step_seconds(records)))
            print(f"seed {seed} {name}: target at step {reached}, final loss {records[-1]['loss']:.4f}", flush=True)
    print(f"\ntiny, {args.steps} steps, target: mean loss of {WINDOW} steps <= {args.target}, seeds {args.seeds}")
    print(f"{'optimizer':10} {'steps to target (median, min-max)':36} {'final loss (mean ± sd)':24} step time")
    for name, rows in results.items():
        reached = [r for r, _, _ in rows if r is not None]
        finals = [f for _, f, _ in rows]
        spread = f"{statistics.median(reached):.0f} ({min(reached)}-{max(reached)})" if reached else "not reached"
        missed = len(rows) - len(reached)
        spread += f", {missed} missed" if missed else ""
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        seconds = statistics.median(s for _, _, s in rows)
        print(f"{name:10} {spread:36} {statistics.fmean(finals):.4f} ± {sd:.4f}{'':8} {seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
