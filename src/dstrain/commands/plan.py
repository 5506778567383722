"""``dstrain plan``: the fastest layout that fits a recipe on a cluster, predicted in seconds without a GPU, and
written as a ds_config that dstrain.train takes unchanged. The layouts are dstrain.plan.layouts', the time
model dstrain.plan.time_model's (its assumptions are printed with the table).

    dstrain plan --recipe recipes/llama-7b.yaml --nodes 4 --gpus-per-node 8 --device h100-sxm --out ds_configs/plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from dstrain.checkpoint.model_source import load_recipe_to_size
from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.options import given
from dstrain.plan.layouts import Planned, longest_fitting_sequence, plan, smallest_fitting_nodes
from dstrain.plan.memory_parts import GIB
from dstrain.plan.reference_memory import reference_seconds_per_token
from dstrain.plan.time_model import DEVICES, Cluster, Device
from dstrain.precision import Precision
from dstrain.strategy.optimizer import MUON_MOE_IN_BF16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe YAML (the experiment)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    parser.add_argument("--gpus-per-node", "--gpus_per_node", type=int, default=8, help="devices per node (default: 8)")
    parser.add_argument("--device", choices=sorted(DEVICES), default=None, help="a known device (default: h100-sxm)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GiB", help="memory per device")
    parser.add_argument(
        "--host-gib",
        type=float,
        default=None,
        metavar="GiB",
        help="host memory per node that offloaded state and host-held checkpoints may take (default: the device's, "
        "2048 for an H100 node)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="T", help="dense bf16 TFLOP/s per device")
    for where in ("intra", "inter"):
        help_text = f"Gbit/s per device, {where}-node"
        parser.add_argument(f"--{where}-node-gbps", type=float, default=None, metavar="B", help=help_text)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="plan for this machine: time the recipe's forward+backward and a gloo all-reduce first (seconds)",
    )
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default=None,
        help="the precision to train in (default: bf16 on a device, fp32 with --calibrate); Muon with model.moe "
        "trains in fp32 only",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts to show (default: 5)")
    parser.add_argument("--out", type=Path, default=None, help="write the fastest layout's ds_config here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.vocab_size=50304")


def check_arguments(args: argparse.Namespace) -> None:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise DstrainError(f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: both must be at least 1")
    for flag in ("device_memory", "host_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise DstrainError(f"--{flag.replace('_', '-')} {value:g}: must be positive")
    if args.top < 1:
        raise DstrainError(f"--top {args.top}: show at least 1 layout")
    if args.calibrate and args.precision == "bf16":
        raise DstrainError("--calibrate measures this machine's fp32 speed; drop --precision bf16")
    if args.calibrate and args.device:
        raise DstrainError("--calibrate measures this machine; drop --device (or drop --calibrate to plan for it)")
    if args.out is not None and args.out.exists():
        raise DstrainError(f"--out {args.out}: the file exists; name a new file (plan never overwrites a config)")


def device_of(args: argparse.Namespace, recipe: Recipe) -> tuple[Device, Precision]:
    """The device the plan is for, and the precision it trains in."""
    if args.calibrate:
        from dstrain.plan.calibrate import calibrated_device

        return calibrated_device(recipe, args.nodes * args.gpus_per_node), "fp32"
    device = DEVICES[given(args.device, "h100-sxm")]
    changes: dict = {}
    if args.device_memory is not None:
        changes["memory_gib"] = args.device_memory
    if args.host_gib is not None:
        changes["host_memory_gib"] = args.host_gib
    if args.peak_tflops is not None:
        changes["peak_tflops"] = {"bf16": args.peak_tflops, "fp16": args.peak_tflops, "fp32": args.peak_tflops / 15}
    if args.intra_node_gbps is not None:
        changes["intra_node_gbps"] = args.intra_node_gbps
    if args.inter_node_gbps is not None:
        changes["inter_node_gbps"] = args.inter_node_gbps
    if set(changes) - {"host_memory_gib"} and args.device is None:
        changes["name"] = "custom"
    return dataclasses.replace(device, **changes), given(args.precision, "bf16")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    recipe = load_recipe_to_size(args.recipe, args.overrides, "plan")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed announces its accelerator on stdout
        device, precision = device_of(args, recipe)
        cluster = Cluster(device, args.nodes, args.gpus_per_node)
        found, fitting = plan(recipe, cluster, precision, args.top, torch_adam=args.calibrate)
    if not found:
        raise DstrainError(f"{args.recipe}: {fits_nowhere(recipe, cluster, precision)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found[0].ds_config, indent=2) + "\n")
    if args.json:
        print(json.dumps([summary(p) for p in found], indent=2))
    else:
        print_plan(found, cluster, fitting, args.out)
        if found[0].estimate.reference_pass:  # the objective's pass before step 1 (its memory term)
            print(reference_line(recipe, found[0], cluster))
    return 0


def reference_line(recipe: Recipe, best: Planned, cluster: Cluster) -> str:
    """The fastest layout's reference pass (dstrain.plan.reference_memory): its memory and its time beside an
    epoch of training on the same pairs (forward FLOPs at the training precision's rate)."""
    world, tokens = cluster.nodes * cluster.gpus_per_node, best.strategy.micro_batch * recipe.data.seq_len
    per_token = reference_seconds_per_token(recipe, world, cluster.device.rate(best.strategy.precision, tokens))
    train_per_token = best.prediction.step_s / (recipe.train.global_batch * recipe.data.seq_len)
    est = best.estimate
    return (
        f"reference pass before step 1 (layout 1): {est.total('device', 'reference') / GIB:.1f} GiB per device "
        f"(the engine's no-grad forwards), {per_token * 1e6:.3g} s per million tokens of pairs, forward only: "
        f"{per_token / train_per_token:.2g} x an epoch of training on them"
    )


def fits_nowhere(recipe: Recipe, cluster: Cluster, precision: Precision) -> str:
    """The one line when nothing fits, but the recipe's file: what would (more nodes, a shorter sequence, fp32 for
    Muon with MoE)."""
    if precision == "bf16" and recipe.optim.kind == "muon" and recipe.model.moe is not None:
        return f"no layout dstrain accepts in bf16: {MUON_MOE_IN_BF16}; plan it with --precision fp32"
    with contextlib.redirect_stdout(sys.stderr):
        nodes = smallest_fitting_nodes(recipe, cluster, precision)
        seq = longest_fitting_sequence(recipe, cluster, precision)
    fixes = [f"{nodes} nodes (--nodes {nodes})"] if nodes else []
    fixes += [f"data.seq_len={seq}"] if seq else []
    fix = f"what fits: {' or '.join(fixes)}" if fixes else "none fits on up to 1024 nodes or at 1024 tokens either"
    d = cluster.device
    return (
        f"no layout dstrain accepts fits {cluster.nodes} x {cluster.gpus_per_node} devices of "
        f"{d.memory_gib:.4g} GiB with {d.host_memory_gib:.4g} GiB of host memory per node; {fix}, "
        f"or pick a device with more memory"
    )


def summary(p: Planned) -> dict:
    return {
        "layout": p.layout.describe(),
        "micro_batch": p.strategy.micro_batch,
        "grad_accum": p.strategy.grad_accum,
        "memory_gib": (p.estimate.peak("device") + p.estimate.reserve) / GIB,
        "reference_pass_gib": p.estimate.total("device", "reference") / GIB if p.estimate.reference_pass else None,
        "host_gib_per_node": p.estimate.peak("cpu") * p.estimate.gpus_per_node / GIB,
        "step_s": p.prediction.step_s,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "bound": p.prediction.bound,
        "compute_s": p.prediction.compute_s,
        "comm_s": p.prediction.comm_s,
        "bubble_s": p.prediction.bubble_s,
        "offload_s": p.prediction.offload_s,
        "ds_config": p.ds_config,
    }


def print_plan(best: list[Planned], cluster: Cluster, total: int, out: Path | None) -> None:
    d = cluster.device
    print(
        f"{total} layouts fit {cluster.nodes} x {cluster.gpus_per_node} {d.name} ({d.memory_gib:.4g} GiB, "
        f"{d.host_memory_gib:.4g} GiB host per node, "
        f"{d.efficiency:.0%} of {max(d.peak_tflops.values()):.4g} TFLOP/s reached, "
        f"{d.intra_node_gbps:.4g}/{d.inter_node_gbps:.4g} Gbit/s "
        f"intra/inter-node); fastest first:"
    )
    columns = f"{'micro':>5} {'accum':>5} {'GiB':>6} {'host':>6} {'step s':>9} {'tokens/s':>10} {'MFU':>6}"
    print(f"{'#':>2}  {'layout':<44} {columns}  bound")
    for i, p in enumerate(best, 1):
        mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
        print(
            f"{i:>2}  {p.layout.describe():<44} {p.strategy.micro_batch:>5} {p.strategy.grad_accum:>5} "
            f"{(p.estimate.peak('device') + p.estimate.reserve) / GIB:>6.1f} "
            f"{p.estimate.peak('cpu') * cluster.gpus_per_node / GIB:>6.0f} {p.prediction.step_s:>9.4g} "
            f"{p.tokens_per_s:>10,.0f} {mfu:>6}  {p.prediction.bound}"
        )
    if out is not None:
        print(f"wrote {out}: train with --deepspeed_config {out}")
