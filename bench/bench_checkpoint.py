"""How long a checkpoint stops training: synchronous save against a background one (train.async_checkpoint).

For each recipe's model (its real dimensions, ZeRO-1 fp32, AdamW state after one step), in one process:
- sync: seconds `dstrain.checkpoint.store.save` blocks the loop (write + publish);
- async blocked: seconds `BackgroundSaves.start` blocks it (host-memory snapshot), and the background write's own
  duration (while training steps run);
- steps/s while the background write runs, against steps/s without one;
- the checksums' share of a sync save: XXH3-64 over the checkpoint's bytes (in memory, as ChecksummedEngine hashes
  them on their way to disk), against the sync save that includes it.
Each figure is the median of --repeats saves. Targets: async blocked <= 20% of sync; checksums <= 5% of sync.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_checkpoint.py [--recipes tiny gpt2-125m] [--dir /tmp/x]

Runs as a world of one (gloo); no data needed (random tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORTEN = {"tiny": ["model.vocab_size=4096", "data.seq_len=128"], "gpt2-125m": ["data.seq_len=128"]}


def build(name: str):
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_engine, build_model

    recipe = load_recipe_and_source(ROOT / "recipes" / f"{name}.yaml", [*SHORTEN[name], "train.global_batch=1"])[0]
    config = ROOT / "ds_configs" / "zero1.json"
    raw = load_ds_config(config)
    raw["train_micro_batch_size_per_gpu"] = 1
    strategy = resolve(recipe, "recipe", raw, config, 1)
    return recipe, build_engine(recipe, strategy, build_model(recipe, strategy))


def step(engine, recipe) -> float:
    import torch

    from dstrain.model.gpt import lm_loss

    start = time.perf_counter()
    tokens = torch.randint(0, recipe.model.vocab_size, (1, recipe.data.seq_len + 1)).to(engine.device)
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
    engine.step()
    return time.perf_counter() - start


def measure(name: str, folder: Path, repeats: int) -> dict:
    from dstrain.checkpoint import store
    from dstrain.checkpoint.background import BackgroundSaves

    recipe, engine = build(name)
    step(engine, recipe)  # the optimizer's state exists from the first step
    state = {"consumed_samples": 0}
    sync, blocked, written, during, alone = [], [], [], [], []
    saves = BackgroundSaves(engine, folder, keep_last=2, identity=None)
    for i in range(repeats):
        start = time.perf_counter()
        store.save(engine, folder, 2 * i + 1, state, keep_last=2)
        sync.append(time.perf_counter() - start)
        alone.append(step(engine, recipe))
        start = time.perf_counter()
        saves.start(2 * i + 2, state)
        blocked.append(time.perf_counter() - start)
        while not saves.done():
            during.append(step(engine, recipe))
        saves.wait()
        written.append(saves.write_s)
    files = [p for p in (folder / (folder / "latest").read_text()).rglob("*") if p.is_file()]
    size, hashed = sum(p.stat().st_size for p in files), hash_seconds(files, repeats)
    return {
        "hash_s": hashed,
        "recipe": name,
        "checkpoint_mib": size / 2**20,
        "sync_s": statistics.median(sync),
        "async_blocked_s": statistics.median(blocked),
        "async_written_s": statistics.median(written),
        "blocked_share": statistics.median(blocked) / statistics.median(sync),
        "hash_share": hashed / statistics.median(sync),
        "steps_per_s_alone": 1 / statistics.median(alone),
        "steps_per_s_during_write": 1 / statistics.median(during) if during else None,
    }


def hash_seconds(files: list[Path], repeats: int) -> float:
    """Median seconds XXH3-64 takes over these files' bytes (read first: the hash alone, not the disk)."""
    import xxhash

    blobs = [p.read_bytes() for p in files]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for blob in blobs:
            xxhash.xxh3_64(blob).hexdigest()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["tiny", "gpt2-125m"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dstrain.train.process import distributed

    distributed.init()
    for name in args.recipes:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            r = measure(name, Path(tmp), args.repeats)
        during = r["steps_per_s_during_write"]
        print(
            f"{name}: {r['checkpoint_mib']:.0f} MiB; sync save blocks {r['sync_s']:.2f} s; async blocks "
            f"{r['async_blocked_s']:.2f} s ({100 * r['blocked_share']:.0f}%), written in {r['async_written_s']:.2f} s; "
            f"steps/s {r['steps_per_s_alone']:.2f} alone, "
            + (f"{during:.2f} during the write" if during else "no step fit in the write")
            + f"; checksums {r['hash_s']:.3f} s ({100 * r['hash_share']:.1f}% of the sync save)",
            flush=True,
        )


if __name__ == "__main__":
    main()
