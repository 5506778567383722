"""LoRA's cost against full fine-tuning of the same recipe, side by side in one run (CPU, fp32, a world of one).

Each variant is dstrain's engine (build_model, then build_engine with the recipe's model converters: LoRA's adapters
on every linear layer, the base frozen) taking optimizer steps on the same random micro-batches, in its own process
(its own peak memory), in alternating blocks (full, lora, full, lora, ...) so that a drift of the machine's speed
touches both. Reported: the median step time of each and the ratio LoRA ÷ full; the peak resident memory each
process added over its baseline (after the imports, before the model), and the training state it holds (parameters,
gradients and optimizer moments, counted from the tensors), each as LoRA ÷ full.

    OMP_NUM_THREADS=2 python bench/bench_lora.py [--d-model 256] [--layers 4] [--seq 128] [--micro 4] [--steps 6]
        [--blocks 2] [--rank 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def recipe_file(args: argparse.Namespace, folder: Path, lora: bool) -> Path:
    recipe = {
        "name": "bench-lora",
        "model": {
            "flavour": "llama",
            "vocab_size": 4096,
            "n_layer": args.layers,
            "n_head": 8,
            "n_kv_head": 4,
            "d_model": args.d_model,
            "max_seq_len": args.seq,
        },  # fmt: skip
        "data": {"sources": [{"path": "unused"}], "seq_len": args.seq},
        "train": {"global_batch": args.micro, "steps": 1000},
        "optim": {"lr": 1e-4, "weight_decay": 0.0},
    }
    if lora:
        recipe["lora"] = {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": ["all-linear"]}
    path = folder / f"{'lora' if lora else 'full'}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def state_bytes(engine) -> int:
    """Bytes of the parameters, their gradients and the optimizer's moments."""
    import torch

    total = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    total += sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters() if p.grad is not None)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def measure(recipe: Path, steps: int) -> dict:
    """One variant in this process: its step times, peak memory over the baseline and training state."""
    import torch

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.gpt import lm_loss
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_engine, build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29591"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    torch.distributed.init_process_group("gloo")
    config = ROOT / "ds_configs" / "zero0.json"
    loaded = load_recipe_and_source(recipe)[0]
    strategy = resolve(loaded, recipe, load_ds_config(config), config, 1)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = build_engine(loaded, strategy, build_model(loaded, strategy))
    generator = torch.Generator().manual_seed(0)
    times = []
    shape = (strategy.micro_batch, loaded.data.seq_len)
    for _ in range(steps):
        ids = torch.randint(0, loaded.model.vocab_size, shape, generator=generator)
        start = time.perf_counter()
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {"times": times[2:], "peak_added": peak, "state": state_bytes(engine), "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps a block (the first 2 warm up)")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each variant")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variant", type=Path, default=None, help=argparse.SUPPRESS)  # a child: this recipe
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args.variant, args.steps)))
        return
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as tmp:
        recipes = {name: recipe_file(args, Path(tmp), name == "lora") for name in results}
        for block in range(args.blocks):
            for name in results:
                command = [sys.executable, __file__, "--variant", str(recipes[name]), "--steps", str(args.steps)]
                env = {**os.environ, "BENCH_PORT": str(29591 + block), "PYTHONWARNINGS": "ignore"}
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    step = {name: statistics.median(t for r in runs for t in r["times"]) for name, runs in results.items()}
    peak = {name: max(r["peak_added"] for r in runs) for name, runs in results.items()}
    state = {name: runs[0]["state"] for name, runs in results.items()}
    trainable = {name: runs[0]["trainable"] for name, runs in results.items()}
    figures = {
        "model": f"llama d_model {args.d_model}, {args.layers} blocks, vocab 4096; {args.micro} x {args.seq} tokens",
        "lora": f"rank {args.rank}, all-linear",
        "trainable_params": trainable,
        "step_ms": {name: round(s * 1e3, 1) for name, s in step.items()},
        "step_lora_over_full": round(step["lora"] / step["full"], 3),
        "peak_added_mib": {name: round(p / 2**20, 1) for name, p in peak.items()},
        "peak_lora_over_full": round(peak["lora"] / peak["full"], 3),
        "state_mib": {name: round(s / 2**20, 1) for name, s in state.items()},
        "state_lora_over_full": round(state["lora"] / state["full"], 3),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
