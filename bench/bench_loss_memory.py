"""Process peak RSS of a training step of a 151,936-entry-vocabulary model (Qwen2.5's), with the loss whole and
chunked, against what ``dstrain estimate`` says for the same recipe and ds_config. Each figure comes from a fresh
child process (the trainer's engine: ZeRO-0, fp32, one rank on this CPU), so one's peak cannot hide the other's.

    python bench/bench_loss_memory.py [--seq 1024] [--micro 1] [--tiles 8]

Measured: the child's peak RSS (getrusage ru_maxrss) over two steps (the first allocates Adam's moments, which the
estimate counts as a running job holds them) minus its RSS once torch and DeepSpeed are imported and the process
group is up, before the model is built: the model states, the activations and the loss of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def write_inputs(folder: Path, seq: int, micro: int, tiles: int) -> tuple[Path, Path]:
    """A 2-block llama with Qwen2.5's vocabulary (untied head) and ds_configs/zero0.json with tiling.loss set."""
    recipe = {
        "name": "loss-memory",
        "seed": 0,
        "model": {"flavour": "llama", "vocab_size": 151936, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 128},
        "data": {"sources": [{"path": str(folder / "no-data")}], "seq_len": seq},
        "train": {"global_batch": micro, "steps": 1},
    }
    recipe_file = folder / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    config = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    config.update(train_micro_batch_size_per_gpu=micro, tiling={"loss": tiles})
    ds_file = folder / f"zero0-loss{tiles}.json"
    ds_file.write_text(json.dumps(config))
    return recipe_file, ds_file


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(recipe_file: str, ds_file: str) -> dict:
    """Two steps through the trainer's engine and ModelForward's loss; the peak RSS above the imported baseline."""
    import torch

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.gpt import lm_loss
    from dstrain.plan.memory import estimate
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine import tiling
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.process import distributed

    distributed.init()
    baseline = rss_bytes()
    recipe = load_recipe_and_source(recipe_file)[0]
    strategy = resolve(recipe, recipe_file, load_ds_config(ds_file), ds_file, 1)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    for _ in range(2):  # the first step allocates Adam's moments; the second is a step of a running job
        ids = torch.randint(0, recipe.model.vocab_size, (strategy.micro_batch, recipe.data.seq_len + 1))
        inputs, labels = ids[:, :-1], ids[:, 1:]
        if strategy.loss_tiles > 1:
            loss = tiling.mean_loss(engine.module.lm_head, engine(inputs, head=False), labels, strategy.loss_tiles)
        else:
            loss = lm_loss(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    est = estimate(recipe, strategy, 1, 1, fused_norms=False)  # torch's composite RMSNorm on a CPU
    logits = sum(p.backward for p in est.parts if "logits" in p.name)
    return {"tiles": strategy.loss_tiles, "measured": peak, "estimate": est.peak(), "logits": logits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--tiles", type=int, default=8)
    parser.add_argument("--child", nargs=2, metavar=("RECIPE", "DS_CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tiles in (1, args.tiles):
            recipe_file, ds_file = write_inputs(Path(tmp), args.seq, args.micro, tiles)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(recipe_file), str(ds_file)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"llama 2 x d_model 128, vocabulary 151,936 (untied), seq {args.seq} x micro {args.micro}, fp32, ZeRO-0")
    print("| loss | peak RSS above baseline GiB | estimate GiB | estimate / measured | estimate's logits GiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = "whole" if r["tiles"] == 1 else f"{r['tiles']} tiles"
        print(
            f"| {name} | {r['measured'] / GIB:.3f} | {r['estimate'] / GIB:.3f} | {r['estimate'] / r['measured']:.2f} "
            f"| {r['logits'] / GIB:.3f} |"
        )
    whole, chunked = rows
    print(
        f"chunked / whole: measured {chunked['measured'] / whole['measured']:.2f}, "
        f"estimated {chunked['estimate'] / whole['estimate']:.2f}"
    )


if __name__ == "__main__":
    main()
