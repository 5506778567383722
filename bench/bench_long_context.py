"""The longest sample ``dstrain estimate`` fits for Llama-3.1-8B on 1, 8 and 32 H100s (80 GiB) with Arctic Long
Sequence Training's levers, beside ALST's published lengths for the same hardware (arXiv 2506.13996: 500K tokens on
1 H100, 3.7M on 8, over 15M on 32; host memory 1.9 TB per node). No GPU: the memory model only.

    python bench/bench_long_context.py [--recipe recipes/continue-llama3.1-8b-1m.yaml]

Levers, as ALST sets them: ZeRO-3, micro-batch 1, Ulysses SP over every device up to the 32 query heads (key/value
heads repeated beyond 8), activation checkpoints held on the host, the chunked loss and the tiled MLP (4 tiles); with
the optimizer (and, on one device, the parameters) offloaded to the host where that fits longer. The length is
searched in steps of 64K tokens; a node's host memory is capped at ALST's 1.9 TB.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = 65536
ALST = {1: "500K", 8: "3.7M", 32: "15M+"}
HOST_GIB = 1.9e12 / 2**30  # ALST's nodes: 1.9 TB of host memory each


def longest(recipe_file: Path, nodes: int, gpus: int) -> tuple[int, str, float, float]:
    """(tokens, layout, device GiB, host GiB per node) of the longest fitting sample over the offload choices."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.errors import DstrainError
    from dstrain.plan.layouts import Layout, fits
    from dstrain.plan.memory import estimate
    from dstrain.plan.memory_parts import GIB
    from dstrain.plan.time_model import DEVICES, Cluster
    from dstrain.strategy.resolve import resolve

    world, base = nodes * gpus, load_recipe_and_source(recipe_file)[0]
    cluster = Cluster(dataclasses.replace(DEVICES["h100-sxm"], host_memory_gib=HOST_GIB), nodes, gpus)
    best = (0, "", 0.0, 0.0)
    for offload in ("none", "optimizer", "optimizer+params"):
        layout = Layout(3, 1, sp=min(world, base.model.n_head), offload=offload, checkpointing=True,
                        chunked_loss=True, mlp_tiles=4, host_checkpoints=True)  # fmt: skip

        def fitting(seq: int, layout: Layout = layout):
            recipe = dataclasses.replace(
                base,
                data=dataclasses.replace(base.data, seq_len=seq),
                model=dataclasses.replace(base.model, max_seq_len=seq),
                train=dataclasses.replace(base.train, global_batch=world // layout.sp),
            )
            try:
                strategy = resolve(recipe, recipe_file, layout.ds_config("bf16", False), "plan", world,
                                   check_device=False, validate=False)  # fmt: skip
            except DstrainError:
                return None
            est = estimate(recipe, strategy, nodes, gpus)
            return est if fits(est, cluster) else None

        low, high = 0, 1024  # in STEPs: 64M tokens at most
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fitting(middle * STEP) else (low, middle)
        est = fitting(low * STEP) if low else None
        if est is not None and low * STEP > best[0]:
            host = est.peak("cpu") * gpus / GIB
            best = (low * STEP, layout.describe(), (est.peak() + est.reserve) / GIB, host)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "continue-llama3.1-8b-1m.yaml")
    args = parser.parse_args()
    print("| H100s | ALST published | dstrain estimate: longest sample | layout | device GiB | host GiB per node |")
    print("|---|---|---|---|---|---|")
    for nodes, gpus in ((1, 1), (1, 8), (4, 8)):
        with contextlib.redirect_stdout(sys.stderr):
            tokens, layout, device, host = longest(args.recipe, nodes, gpus)
        world = nodes * gpus
        print(
            f"| {world} | {ALST[world]} | {tokens / 2**20:.2f}M ({tokens:,}) | {layout} | {device:.1f} | {host:.0f} |"
        )


if __name__ == "__main__":
    main()
