"""Process peak RSS of a training step with activation checkpoints held on the host
(``activation_checkpointing.cpu_checkpointing``) and on the device, against what ``dstrain estimate`` says for the
same recipe and ds_config. Each figure comes from a fresh child process (the trainer's engine: ZeRO-0, fp32, one rank
on this CPU), so one's peak cannot hide the other's.

    python bench/bench_host_checkpoints.py [--seq 4096] [--layers 8] [--d-model 256]

On a CPU the device is the host: both settings should peak alike, and the estimate's device and host columns
together (the block inputs move from one to the other) should match both. Measured: the child's peak RSS (getrusage
ru_maxrss) over two steps minus its RSS once the process group is up, before the model is built.
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


def write_inputs(folder: Path, seq: int, layers: int, d_model: int, host: bool) -> tuple[Path, Path]:
    """A llama of ``layers`` blocks (small vocabulary: the block inputs dominate) and ds_configs/zero0.json with
    activation checkpointing, its inputs held on the host or not."""
    model = {"flavour": "llama", "vocab_size": 512, "n_layer": layers, "n_head": 4, "n_kv_head": 2, "d_model": d_model}
    recipe = {
        "name": "host-checkpoints",
        "seed": 0,
        "model": model,
        "data": {"sources": [{"path": str(folder / "no-data")}], "seq_len": seq},
        "train": {"global_batch": 1, "steps": 1},
    }
    recipe_file = folder / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    config = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    config.update(
        train_micro_batch_size_per_gpu=1,
        tiling={"loss": 1},
        activation_checkpointing={"partition_activations": False, "cpu_checkpointing": host},
    )
    ds_file = folder / f"zero0-host{int(host)}.json"
    ds_file.write_text(json.dumps(config))
    return recipe_file, ds_file


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(recipe_file: str, ds_file: str) -> dict:
    """Two steps through the trainer's engine; the peak RSS above the baseline, and the estimate's figures."""
    import torch

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.gpt import lm_loss
    from dstrain.plan.memory import estimate
    from dstrain.plan.memory_parts import PHASES
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.process import distributed

    distributed.init()
    baseline = rss_bytes()
    recipe = load_recipe_and_source(recipe_file)[0]
    strategy = resolve(recipe, recipe_file, load_ds_config(ds_file), ds_file, 1)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    for _ in range(2):  # the first step allocates Adam's moments; the second is a step of a running job
        ids = torch.randint(0, recipe.model.vocab_size, (strategy.micro_batch, recipe.data.seq_len + 1))
        engine.backward(lm_loss(engine(ids[:, :-1]), ids[:, 1:]))
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    est = estimate(recipe, strategy, 1, 1, fused_norms=False)  # torch's composite RMSNorm on a CPU
    both = max(est.total("device", phase) + est.total("cpu", phase) for phase in PHASES)
    return {
        "host": strategy.host_checkpoints,
        "measured": peak,
        "estimate": both,
        "device": est.peak("device"),
        "cpu": est.peak("cpu"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--child", nargs=2, metavar=("RECIPE", "DS_CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for host in (False, True):
            recipe_file, ds_file = write_inputs(Path(tmp), args.seq, args.layers, args.d_model, host)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(recipe_file), str(ds_file)],
                capture_output=True,
                text=True,
                check=True,
                # a fixed mmap threshold: freed tensors go back to the system, so the peak RSS is what was held
                env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"llama {args.layers} x d_model {args.d_model}, seq {args.seq}, fp32, ZeRO-0, activation checkpointing")
    print("| checkpoints | peak RSS above baseline GiB | estimate GiB (device + host) | estimate / measured "
          "| estimate's device GiB | estimate's host GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'host' if r['host'] else 'device'} | {r['measured'] / GIB:.4f} | {r['estimate'] / GIB:.4f} "
            f"| {r['estimate'] / r['measured']:.2f} | {r['device'] / GIB:.4f} | {r['cpu'] / GIB:.4f} |"
        )
    device, host = rows
    print(
        f"host / device: measured {host['measured'] / device['measured']:.3f}, estimated (device + host) "
        f"{host['estimate'] / device['estimate']:.3f}; device memory the estimate frees: "
        f"{(device['device'] - host['device']) / GIB:.4f} GiB"
    )


if __name__ == "__main__":
    main()
