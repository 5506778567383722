"""``dstrain doctor``: does every strategy still give ZeRO-0's math on this machine, DeepSpeed, torch and drivers?

    dstrain doctor --recipe R [--deepspeed_configs C1 C2 ...] [--nproc N] [--steps 10] [--quick] [--at-recipe-size]
        --out DIR [key=value ...]

A small model of the recipe's family and features (2 blocks of width 64, 32-token samples, a global batch of 8, on
the recipe's own data; ``--at-recipe-size``: the recipe's own) trains ``--steps`` steps under each listed ds_config,
or every shipped one (ds_configs/*.json) when none is listed, at gradient accumulation >= 2 and as shipped where
that is 1, all in one launch of the deepspeed launcher (commands/doctor_plan.py plans the runs). Each is compared
step by step with the baseline in its precision, within a per-step tolerance its twin sets (commands/doctor_report.py);
a probe in each rank gives the gradient checks (train/doctor/probe.py, commands/doctor_checks.py); beside them a run
stopped after half its steps under ZeRO-1 and resumed under ZeRO-3, and the kernel checks and collective bandwidths
of dstrain.train.doctor.checks. DIR gets report.md, doctor.json and doctor.png; the exit status is 1 if a strategy,
a gradient check or a kernel is outside its tolerance. ``--quick``: the subset a CI job runs (doctor_plan.QUICK).

A ds_config that does not parse, or that this machine or world size cannot run, is one line of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dstrain.commands.doctor_plan import plan_runs, shipped_configs
from dstrain.errors import DstrainError
from dstrain.options import given

TIMEOUT_S = 1800
# A run that fails on one rank leaves the others in a collective: this bounds their wait (the trainer's
# DSTRAIN_COLLECTIVE_TIMEOUT_S), so the launch goes on to the next run instead of hanging for half an hour.
COLLECTIVE_TIMEOUT_S = "60"


def run_overrides(steps: int) -> list[str]:
    """What every doctor run sets at any size: its steps, a record per step, no evaluation, checkpoint or tasks."""
    return [
        f"train.steps={steps}",
        "train.tokens=null",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.eval_samples=8",
        "train.checkpoint_interval=0",
        "train.tasks=[]",
    ]


def at_recipe_size(recipe, steps: int) -> list[str]:
    """The recipe's own model, sequence and global batch for ``steps`` steps; its warmup shortened to a fifth of them
    where it is longer (tiny.yaml's 20 of 200), so the steps reach the full learning rate."""
    warmup = min(recipe.schedule.warmup_steps, max(1, steps // 5))
    return [*run_overrides(steps), "init_from=null", f"schedule.warmup_steps={warmup}"]


def small_model(recipe, steps: int = 10) -> list[str]:
    """Overrides that keep the recipe's family and features (attention kind, norms, RoPE, windows, MoE, tying,
    document masking) at doctor's size: 2 blocks, d_model 64, 8 query heads (4 key/value heads where the recipe
    groups them: SP up to 4 then), 32 tokens, a global batch of 8."""
    model = recipe.model
    kv = None if model.n_kv_head is None else (8 if model.n_kv_head == model.n_head else 4)
    overrides = [
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=8",
        f"model.n_kv_head={'null' if kv is None else kv}",
        f"model.d_head={'null' if model.d_head is None else 16}",
        f"model.d_ff={'null' if model.d_ff is None else 128}",
        f"model.nope_layers={[i for i in model.nope_layers if i < 2]}",
        "data.seq_len=32",
        "train.global_batch=8",
        *run_overrides(steps),
        "init_from=null",
        "schedule.warmup_steps=2",
    ]
    if model.sliding_window is not None:
        overrides.append("model.sliding_window=8")  # shorter than the samples, so the window masks something
    if model.layer_types is not None:
        overrides.append("model.layer_types=[sliding_attention,full_attention]")
    if model.moe is not None:
        overrides += ["model.moe.d_expert=32", f"model.moe.dense_layers={[i for i in model.moe.dense_layers if i < 2]}"]
    return overrides


def launch(plan_file: Path, nproc: int, log: Path, collective_s: str = COLLECTIVE_TIMEOUT_S) -> int:
    """One deepspeed launch for every run (dstrain.train.doctor.runs); its output goes to ``log``."""
    from dstrain.train.process.distributed import free_port

    beside = Path(sys.executable).parent / "deepspeed"  # a venv's bin/ need not be on PATH
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if not found:
        raise DstrainError("the deepspeed launcher is not installed in this environment; pip install deepspeed")
    master, meeting = free_port(), free_port()
    while meeting == master:
        meeting = free_port()
    command = [found, "--num_gpus", str(nproc), "--master_port", str(master)]
    command += ["--module", "dstrain.train.doctor.runs", str(plan_file)]
    env = {**os.environ, "DSTRAIN_COLLECTIVE_TIMEOUT_S": os.environ.get("DSTRAIN_COLLECTIVE_TIMEOUT_S", collective_s)}
    env["DSTRAIN_DOCTOR_PORT"] = str(meeting)  # where the ranks meet between runs (train.doctor.runs.Between)
    with log.open("w") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, env=env)
            return done.returncode
        except subprocess.TimeoutExpired:
            out.write(f"dstrain doctor: the launch ran past {TIMEOUT_S} s and was stopped\n")
            return 124


def planned_bandwidth() -> str:
    """What `dstrain plan` assumes of this machine's links, to set beside the measured bandwidths."""
    import torch

    from dstrain.plan.time_model import DEVICES

    if not torch.cuda.is_available():
        return "dstrain plan assumes no CPU figure: `dstrain plan --calibrate` measures a 2-rank all-reduce"
    name = torch.cuda.get_device_name().lower()
    for key, device in DEVICES.items():
        if key.split("-")[0] in name:
            return f"dstrain plan --device {key} assumes {device.intra_node_gbps:g} Gbit/s bus bandwidth in a node"
    return f"dstrain plan knows no {name}: `dstrain plan --calibrate` measures it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe YAML: its model family and features, and its data")
    parser.add_argument(
        "--deepspeed_configs",
        "--deepspeed-configs",
        nargs="*",
        default=[],
        metavar="CONFIG",
        help="ds_configs to check against ZeRO-0 (default: every shipped one this machine can run)",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every local GPU; 2 on a CPU)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each run (default 10)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the subset a CI job runs in about a minute: ZeRO-1/2/3 and bf16 ZeRO-1/2 at accumulation 2, the tied "
        "head under bf16 ZeRO-2; no accumulation-1 runs, resume or kernel checks",
    )
    parser.add_argument(
        "--at-recipe-size",
        action="store_true",
        help="train the recipe's own model, sequence length and global batch (slower) instead of doctor's small "
        "model: its per-step tolerances come from ZeRO-0 at another micro-batch at that size",
    )
    parser.add_argument("--out", type=Path, required=True, help="report folder (report.md, doctor.json, doctor.png)")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides for every run")


def prepare(args: argparse.Namespace) -> tuple[Path, list[dict], dict, int, list[str], list[str]]:
    """Check the inputs and write the plan of runs: (plan file, runs, refusals, ranks, overrides, notes)."""
    from deepspeed.accelerator import get_accelerator

    from dstrain.checkpoint.model_source import load_recipe_and_source

    if args.steps < 2:
        raise DstrainError(f"--steps {args.steps}: doctor needs at least 2 steps (the resume check stops at half)")
    if args.nproc is not None and args.nproc < 1:
        raise DstrainError(f"--nproc {args.nproc}: the ranks must be a positive integer")
    # a CPU runs 2 gloo ranks (data-parallel sums need two); a GPU machine one rank per device
    # nargs="*" swallows the overrides that follow --deepspeed_configs: a ds_config path has no "="
    user_overrides = [*args.overrides, *(c for c in args.deepspeed_configs if "=" in c)]
    listed = [Path(c) for c in args.deepspeed_configs if "=" not in c]
    nproc = given(args.nproc, 2 if get_accelerator().device_name() == "cpu" else get_accelerator().device_count())
    if nproc < 1:
        raise DstrainError(f"--nproc {nproc}: doctor needs at least 1 rank")
    recipe = load_recipe_and_source(args.recipe, user_overrides)[0]
    size = at_recipe_size(recipe, args.steps) if args.at_recipe_size else small_model(recipe, args.steps)
    overrides = [*size, *user_overrides]
    load_recipe_and_source(args.recipe, overrides)  # the small model must be a valid recipe too
    out: Path = args.out
    if (out / "runs").exists():
        raise DstrainError(f"--out {out} already holds doctor's runs; choose another folder or remove it")
    out.mkdir(parents=True, exist_ok=True)
    configs = listed or shipped_configs(args.quick)
    runs, refused, notes = plan_runs(args.recipe, configs, out, overrides, nproc, args.steps, args.quick)
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps({"out": str(out), "runs": runs, "checks": not args.quick}, indent=1))
    return plan_file, runs, refused, nproc, overrides, notes


def main(args: argparse.Namespace) -> int:
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.commands.doctor_report import build_report

    plan_file, runs, refused, nproc, overrides, notes = prepare(args)
    print(f"dstrain doctor: {len(runs)} runs on {nproc} ranks in one launch ({args.out / 'launcher.log'})")
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    code = launch(plan_file, nproc, args.out / "launcher.log", "600" if args.at_recipe_size else COLLECTIVE_TIMEOUT_S)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    context = {"recipe": args.recipe, "ranks": nproc, "steps": args.steps, "overrides": overrides, "launch": code}
    context |= {"notes": notes, "size": "the recipe's own" if args.at_recipe_size else "doctor's small"}
    context |= {"quick": args.quick, "wall_s": time.perf_counter() - start}
    context["cpu_s"] = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    context["planned_bandwidth"] = planned_bandwidth()
    context["tied_recipe"] = load_recipe_and_source(args.recipe, overrides)[0].model.tied
    return build_report(args.out, runs, refused, context)
