"""``dstrain doctor``: does every strategy still give ZeRO-0's math on this machine, DeepSpeed, torch and drivers?

    dstrain doctor --recipe R [--deepspeed_configs C1 C2 ...] [--nproc N] [--steps 10] --out DIR [key=value ...]

A small model of the recipe's family and features (2 blocks of width 64, 32-token samples, a global batch of 8, on
the recipe's own data) trains ``--steps`` steps under ZeRO-0, then under each listed ds_config, or every shipped one
(ds_configs/*.json) when none is listed, all in one launch of the deepspeed launcher. Beside them: ZeRO-0 again with
another micro-batch split (the same sums in another order: the run-to-run floor that sets the fp32 tolerance), a run
stopped after half its steps under ZeRO-1 and resumed under ZeRO-3 (a save and resume across two layouts), and the
kernel checks and collective bandwidths of dstrain.train.doctor.checks. DIR gets report.md, doctor.json and
doctor.png (commands/doctor_report.py); the exit status is 1 if a strategy or a kernel is outside its tolerance.

A ds_config that does not parse, or that this machine or world size cannot run, is one line of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dstrain.commands.doctor_report import BASELINE, TWIN
from dstrain.errors import DstrainError

SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs"
RESUMED = "zero1_then_zero3"  # stopped after half the steps under ZeRO-1, resumed under ZeRO-3
TIMEOUT_S = 1800


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
        f"train.steps={steps}",
        "train.tokens=null",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.eval_samples=8",
        "train.checkpoint_interval=0",
        "train.tasks=[]",
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


def shipped_configs() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("*.json") if p.stem != BASELINE)


def write_twin(out: Path) -> Path:
    """ZeRO-0 with micro-batches of 2: gradients accumulated over two micro-batches before the all-reduce."""
    config = json.loads((SHIPPED / f"{BASELINE}.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 2
    path = out / "configs" / f"{TWIN}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return path


def refusal(recipe_file: str, config: Path, overrides: list[str], nproc: int) -> str | None:
    """Why ``config`` cannot run here, in one line, or None: it does not parse, the recipe or world size refuses it,
    or this machine lacks what it needs (fp16, an NVMe folder, DeepSpeed's async_io op)."""
    from deepspeed.accelerator import get_accelerator

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, offload_of, precision_of, resolve

    try:
        ds = load_ds_config(config)
        if precision_of(ds) == "fp16" and not get_accelerator().is_fp16_supported():
            return f"{get_accelerator().device_name()} has no fp16 (DeepSpeed's accelerator says so)"
        if precision_of(ds) == "bf16" and not get_accelerator().is_bf16_supported():
            return f"{get_accelerator().device_name()} has no bf16 (DeepSpeed's accelerator says so)"
        if "nvme" in (offload_of(ds, "offload_optimizer"), offload_of(ds, "offload_param")):
            zero = ds.get("zero_optimization", {})
            folder = zero.get("offload_param", zero.get("offload_optimizer", {})).get("nvme_path", "")
            if not (Path(folder).is_dir() and os.access(folder, os.W_OK)):
                return f"zero_optimization's nvme_path {folder!r} is no writable folder here"
        resolve(load_recipe_and_source(recipe_file, overrides)[0], recipe_file, ds, str(config), nproc)
    except DstrainError as e:
        return str(e)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # a config DeepSpeed's parser rejects
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def plan_runs(recipe_file: str, configs: list[Path], out: Path, overrides: list[str], nproc: int, steps: int):
    """(runs for the ranks, {name: refusal}) with the baseline, its twin and the resume across layouts first."""
    runs_dir = out / "runs"
    base = overrides

    def argv(config: Path, name: str, *extra: str) -> list[str]:
        return ["--recipe", recipe_file, "--deepspeed_config", str(config), f"run_dir={runs_dir / name}", *base, *extra]

    entries = [(BASELINE, SHIPPED / f"{BASELINE}.json"), (TWIN, write_twin(out))]
    entries += [(config.stem, config) for config in configs if config.stem not in (BASELINE, TWIN)]
    runs: list[dict] = []
    refused: dict[str, str] = {}
    for name, config in entries:
        why = refusal(recipe_file, config, base, nproc)
        if why:
            refused[name] = why
        else:
            runs.append({"name": name, "config": str(config), "argv": argv(config, name)})
    if BASELINE in refused:
        raise DstrainError(f"the baseline {SHIPPED / 'zero0.json'} cannot run here: {refused[BASELINE]}")
    first, second = SHIPPED / "zero1.json", SHIPPED / "zero3.json"
    if not (refusal(recipe_file, first, base, nproc) or refusal(recipe_file, second, base, nproc)):
        runs.append(
            {
                "name": RESUMED,
                "config": f"{first} then {second}",
                "argv": argv(first, RESUMED),
                "stop_after": max(1, steps // 2),
                "resume_argv": argv(second, RESUMED),
            }
        )
    return runs, refused


def launch(plan_file: Path, nproc: int, log: Path) -> int:
    """One deepspeed launch for every run (dstrain.train.doctor.runs); its output goes to ``log``."""
    from dstrain.train.process.distributed import free_port

    beside = Path(sys.executable).parent / "deepspeed"  # a venv's bin/ need not be on PATH
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if not found:
        raise DstrainError("the deepspeed launcher is not installed in this environment; pip install deepspeed")
    command = [found, "--num_gpus", str(nproc), "--master_port", str(free_port())]
    command += ["--module", "dstrain.train.doctor.runs", str(plan_file)]
    with log.open("w") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
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
    parser.add_argument("--out", type=Path, required=True, help="report folder (report.md, doctor.json, doctor.png)")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides for every run")


def prepare(args: argparse.Namespace) -> tuple[Path, list[dict], dict, int, list[str]]:
    """Check the inputs and write the plan of runs: (plan file, runs, refusals, ranks, overrides)."""
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
    nproc = args.nproc or (2 if get_accelerator().device_name() == "cpu" else get_accelerator().device_count())
    recipe = load_recipe_and_source(args.recipe, user_overrides)[0]
    overrides = [*small_model(recipe, args.steps), *user_overrides]
    load_recipe_and_source(args.recipe, overrides)  # the small model must be a valid recipe too
    out: Path = args.out
    if (out / "runs").exists():
        raise DstrainError(f"--out {out} already holds doctor's runs; choose another folder or remove it")
    out.mkdir(parents=True, exist_ok=True)
    configs = listed or shipped_configs()
    runs, refused = plan_runs(args.recipe, configs, out, overrides, nproc, args.steps)
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps({"out": str(out), "runs": runs}, indent=1))
    return plan_file, runs, refused, nproc, overrides


def main(args: argparse.Namespace) -> int:
    from dstrain.commands.doctor_report import build_report

    plan_file, runs, refused, nproc, overrides = prepare(args)
    print(f"dstrain doctor: {len(runs)} runs on {nproc} ranks in one launch ({args.out / 'launcher.log'})")
    code = launch(plan_file, nproc, args.out / "launcher.log")
    context = {"recipe": args.recipe, "ranks": nproc, "steps": args.steps, "overrides": overrides, "launch": code}
    context["planned_bandwidth"] = planned_bandwidth()
    return build_report(args.out, runs, refused, context)
