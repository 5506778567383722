"""Trainer overhead and FLOP accounting, measured side by side in one process.

1. overhead: steady-state tokens/s of dstrain's Trainer.fit against a minimal hand-written DeepSpeed
   loop (engine(x) -> lm_loss -> backward -> step) on the same model, ds_config and batches, in
   alternating blocks so that background load hits both alike. Target ratio >= 0.98.
2. flops: dstrain's flops_per_token (6N + 12·L·d·seq, forward + backward) against DeepSpeed's flops
   profiler (forward FLOPs of the real model, x3 for forward + backward). Target: within 5%.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_trainer.py --data data/pydocs [--recipes tiny gpt2-125m]

Runs as a world of one (gloo); the data folder is any `dstrain prepare` output (the demo's data/pydocs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Shortened so that a CPU measures steady state in minutes; the model dimensions stay the recipe's.
SHORTEN = {
    "tiny": ["train.global_batch=8"],
    "gpt2-125m": ["data.seq_len=256", "train.global_batch=2"],
}
# The trainer logs every step so that each step has its own rate; both sides report the median over
# steps 11..41, which a stray burst of background load does not move.
STEPS, LOG_INTERVAL, MEASURED = 41, 1, slice(10, 41)


def load(recipe_name: str, data: str, run_dir: str):
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, resolve

    overrides = [
        *SHORTEN[recipe_name],
        f"data.sources=[{{path: {data}}}]",
        f"train.steps={STEPS}",
        f"train.log_interval={LOG_INTERVAL}",
        "train.eval_samples=8",
        f"run_dir={run_dir}",
        "train.tokens=null",
        "schedule.warmup_steps=1",
    ]
    recipe = load_recipe_and_source(ROOT / "recipes" / f"{recipe_name}.yaml", overrides)[0]
    config = ROOT / "ds_configs" / "zero1.json"
    raw = load_ds_config(config)
    raw["train_micro_batch_size_per_gpu"] = recipe.train.global_batch
    return recipe, resolve(recipe, "recipe", raw, config, 1)


def trainer_rate(recipe, strategy, train_data, valid_data, run_dir: Path) -> tuple[float, float]:
    """Median tokens/s of Trainer.fit over the measured steps, from its own metrics lines; and the median
    share of a step spent in the loop outside train_step (the trainer's own bookkeeping), which background
    load on the shared model compute cannot blur."""
    from dstrain.run_dir import RunDir
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.loop import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    trainer = Trainer(recipe, strategy, engine, train_data, valid_data, RunDir(run_dir), data_fingerprint="bench")
    inner = []
    train_step = trainer.train_step

    def timed_train_step(batches):
        start = time.perf_counter()
        loss = train_step(batches)
        inner.append(time.perf_counter() - start)
        return loss

    trainer.train_step = timed_train_step
    trainer.fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [
        r["tokens_per_s"]
        for r in records
        if r["step"] in range(MEASURED.start + 1, MEASURED.stop + 1) and "split" not in r and "event" not in r
    ]
    tokens = recipe.train.global_batch * recipe.data.seq_len
    outside = [1 - step * rate / tokens for rate, step in zip(rates, inner[MEASURED])]  # 1 - train_step / whole step
    return statistics.median(rates), statistics.median(outside)


def minimal_rate(recipe, strategy, train_data) -> float:
    """The reference: the loop a user would write by hand around the same engine and batches."""
    from dstrain.data.dataset import collate
    from dstrain.data.sampler import micro_batches
    from dstrain.model.gpt import lm_loss
    from dstrain.train.engine.build import build_engine, build_model

    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    batches = micro_batches(0, recipe.train.global_batch, strategy.micro_batch, 0, 1)
    tokens = recipe.train.global_batch * recipe.data.seq_len
    times = []
    for _ in range(recipe.total_steps):
        start = time.time()
        batch = collate([train_data[i] for i in next(batches)])
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = lm_loss(engine(batch["input_ids"]), batch["labels"])
        engine.backward(loss)
        engine.step()
        loss.item()  # the hand-written loop also looks at its loss each step
        times.append(time.time() - start)
    return tokens / statistics.median(times[MEASURED])


def profiled_flops_per_token(recipe) -> float:
    import torch
    from deepspeed.profiling.flops_profiler import get_model_profile

    from dstrain.model.gpt import GPT

    model = GPT(recipe.model)
    batch, seq = 1, recipe.data.seq_len
    flops, _, _ = get_model_profile(
        model, args=[torch.zeros(batch, seq, dtype=torch.long)], print_profile=False, as_string=False
    )
    return 3 * flops / (batch * seq)  # backward costs twice the forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/pydocs")
    parser.add_argument("--recipes", nargs="+", default=["tiny", "gpt2-125m"])
    parser.add_argument("--blocks", type=int, default=5, help="trainer blocks, each between two minimal-loop blocks")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dstrain.data.dataset import build_dataset, build_valid_sets
    from dstrain.model.counts import flops_per_token
    from dstrain.train.process import distributed

    distributed.init()
    for name in args.recipes:
        with tempfile.TemporaryDirectory() as tmp:
            recipe, strategy = load(name, args.data, tmp)
            sources = [(s.path, s.weight) for s in recipe.data.sources]
            train = build_dataset(
                sources,
                "train",
                recipe.data.seq_len,
                recipe.seed,
                STEPS * recipe.train.global_batch,
                recipe.data.valid_fraction,
            )
            valid = build_valid_sets(sources, recipe.data.seq_len, recipe.seed, recipe.data.valid_fraction)
            # minimal, trainer, minimal, trainer, ..., minimal: each trainer block is compared with the mean of
            # the two minimal blocks around it, so that drift in background load cancels.
            theirs = [minimal_rate(recipe, strategy, train)]
            ours, ratios, outside = [], [], []
            for block in range(args.blocks):
                rate, share = trainer_rate(recipe, strategy, train, valid, Path(tmp) / f"run{block}")
                ours.append(rate)
                outside.append(share)
                theirs.append(minimal_rate(recipe, strategy, train))
                ratios.append(ours[-1] / statistics.mean(theirs[-2:]))
            print(
                f"{name}: trainer {statistics.median(ours):,.0f} tok/s, minimal loop {statistics.median(theirs):,.0f} "
                f"tok/s, ratio {statistics.median(ratios):.3f} (median of {len(ratios)} blocks, range "
                f"{min(ratios):.3f}-{max(ratios):.3f}; target >= 0.98)"
            )
            print(
                f"{name}: the trainer's own loop outside train_step takes {100 * statistics.median(outside):.2f}% "
                f"of a step (the ratio it alone would give: {1 - statistics.median(outside):.4f})"
            )
            ours_flops = flops_per_token(recipe.model, recipe.data.seq_len)
            profiled = profiled_flops_per_token(recipe)
            print(
                f"{name}: flops/token dstrain {ours_flops / 1e6:.2f} M, DeepSpeed profiler {profiled / 1e6:.2f} M, "
                f"difference {100 * (ours_flops / profiled - 1):+.2f}% (target within 5%)"
            )


if __name__ == "__main__":
    main()
