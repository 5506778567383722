"""``dstrain estimate``: memory per device of a recipe under a ds_config, before anything is submitted, and the
cheapest shipped ds_config that fits. The memory model, and its formulas, are dstrain.plan.memory's.

    dstrain estimate --recipe recipes/llama-7b.yaml --deepspeed_config ds_configs/zero3_bf16.json --nodes 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from dstrain.checkpoint.model_source import load_recipe_to_size
from dstrain.config import Recipe
from dstrain.errors import DstrainError, naming_files
from dstrain.options import given
from dstrain.plan.memory import estimate_file
from dstrain.plan.memory_parts import Estimate
from dstrain.precision import Precision


def cost(est: Estimate) -> tuple:
    """Cheapest = least communication and offload: ZeRO-0 < 1 < 2 < 3 < model parallelism < offload (CPU < NVMe)."""
    offload = max({None: 0, "cpu": 1, "nvme": 2}[x] for x in (est.offload_optimizer, est.offload_param))
    return (
        offload,
        est.tp_size * est.pp_stages * est.sp_size > 1,
        est.zero_stage,
        est.tp_size * est.pp_stages * est.sp_size,
        Path(est.ds_config).name,
    )


def cheapest_fitting(
    recipe: Recipe,
    configs_dir: Path,
    precision: Precision,
    nodes: int,
    gpus_per_node: int,
    device_memory_gib: float,
    reserve_gib: float,
) -> Estimate | None:
    """The cheapest ds_config in configs_dir that fits, preferring the given precision; None if none fits."""
    fitting = []
    for path in sorted(configs_dir.glob("*.json")):
        try:
            est = estimate_file(recipe, path, nodes, gpus_per_node, device_memory_gib, reserve_gib)
        except DstrainError:  # not valid for this recipe / world size (micro-batch, model-parallel sizes)
            continue
        if est.fits:
            fitting.append(est)
    fitting.sort(key=lambda e: (e.precision != precision, cost(e)))
    return fitting[0] if fitting else None


def default_configs_dir() -> Path:
    here = Path("ds_configs")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "ds_configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe YAML (the experiment)")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", required=True, help="ds_config JSON (the strategy)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    parser.add_argument("--gpus-per-node", "--gpus_per_node", type=int, default=8, help="devices per node (default: 8)")
    parser.add_argument(
        "--device-memory", type=float, default=80.0, metavar="GiB", help="memory per device (default: 80)"
    )
    parser.add_argument(
        "--reserve",
        type=float,
        default=1.0,
        metavar="GiB",
        help="kept free for the CUDA context, communicator buffers and fragmentation (default: 1)",
    )
    parser.add_argument(
        "--configs-dir", type=Path, default=None, help="where to look for a config that fits (default: ds_configs/)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "overrides", nargs="*", help="dotted recipe overrides, e.g. data.seq_len=2048 model.vocab_size=50304"
    )


def check_arguments(args: argparse.Namespace) -> None:
    if args.device_memory <= 0:
        raise DstrainError(f"--device-memory {args.device_memory:g}: must be the positive GiB of one device, e.g. 80")
    if not 0 <= args.reserve < args.device_memory:
        raise DstrainError(
            f"--reserve {args.reserve:g}: must be at least 0 and below --device-memory {args.device_memory:g}"
        )
    if args.configs_dir is not None and not args.configs_dir.is_dir():
        raise DstrainError(f"--configs-dir {args.configs_dir}: no such folder; name a folder of ds_config files")


def main(args: argparse.Namespace) -> int:
    """Exit status 0 when the config fits, 1 when it does not (so `dstrain estimate ... && sbatch ...` gates a job)."""
    check_arguments(args)
    recipe = load_recipe_to_size(args.recipe, args.overrides, "estimate")
    # DeepSpeed announces its accelerator on stdout the first time it is asked; keep stdout for the estimate.
    with contextlib.redirect_stdout(sys.stderr), naming_files(recipe=args.recipe):
        est = estimate_file(
            recipe, args.deepspeed_config, args.nodes, args.gpus_per_node, args.device_memory, args.reserve
        )
        suggestion = cheapest_fitting(
            recipe,
            given(args.configs_dir, default_configs_dir()),
            est.precision,
            args.nodes,
            args.gpus_per_node,
            args.device_memory,
            args.reserve,
        )
    if args.json:
        data = est.to_json()
        data["cheapest_fitting"] = suggestion.ds_config if suggestion else None
        print(json.dumps(data, indent=2))
    else:
        from dstrain.commands.report import print_estimate

        print_estimate(est, suggestion)
    return 0 if est.fits else 1
