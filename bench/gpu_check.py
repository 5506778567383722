"""dstrain on one GPU, in one command that fits a short loan: speed and MFU, precision, memory, CUDA tests, kernels.

    python3 bench/gpu_check.py OUT --budget-s 420 --skip-done bench/gpu_check_done.json     (on the GPU machine)
    .venv/bin/python bench/gpu_check.py OUT --dry-run      (CPU, toy sizes: the same code paths, for CI)

The parts run in a fixed priority order (PARTS). The plan (each part and its estimated seconds) is printed before
the first part starts; a part whose estimate no longer fits what is left of --budget-s is skipped, saying so;
--skip-done FILE (the gpu_check.json of an earlier loan) skips the parts it measured and carries their figures
over, so two or three short loans add up to the whole table. After every part OUT/gpu_check.json (every figure),
OUT/gpu_check.md (the tables) and OUT/logs.tar.gz are rewritten: a command cut off at its limit still returns
what it finished. Run folders, configs and the unpacked wheels live in --work (default: a temporary folder).

Installs nothing over the machine's torch: wheels from --wheels (built here by `scripts/gpu-wheels`) are unpacked
into WORK/site and put on the path of every run; the demo corpus (data/pydocs) is carried with the working tree
(prepared here if missing). FusedAdam is the one thing compiled there (its JIT build is timed in `precision`).
Exit 1 if a check fails, 2 if --skip-done cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_features as features
import gpu_parts as parts
import yaml
from gpu_report import write_report

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CONFIGS = ["zero0.json", "zero1_bf16.json", "zero2_bf16.json", "zero3_bf16.json"]
MEMORY_CONFIGS += ["zero2_offload.json", "zero3_offload.json"]
SPEED_125M = ("gpt2-125m", 1024, [32, 16], ["eager", "compile"])
SPEED_1_3B = ("gpt-1.3b", 2048, [8, 4], ["eager", "compile"])
MEMORY_MODELS = [("gpt2-125m", 8, 1024), ("gpt2-350m", 8, 1024), ("gpt-1.3b", 2, 2048)]  # (recipe, micro, seq)
DRY_MEMORY = ("tiny", 2, 64)
DRY_SPEED = ("tiny", 64, [4, 2], ["eager"])  # torch.compile is left to the GPU (minutes on 2 cores)
SPEED_STEPS, PRECISION_STEPS, MEMORY_STEPS, DRY_STEPS, PROFILE_STEPS = 30, 20, 5, 4, 10

# The estimate of a part: training runs x (start-up + steps at an assumed MFU) + what compiles. Start-up is the
# process, the imports, the data index, the engine and the final evaluation; the GPU figures are guesses to be
# replaced by the times the first loan measures (gpu_check.json keeps both), the CPU ones measured here.
ASSUMED_MFU, BF16_PEAK = 0.3, 989e12  # H100 SXM dense bf16
RUN_START_S = {True: 14.0, False: 35.0}  # {dry run: seconds}
COMPILE_S, FLEX_COMPILE_S, FUSED_ADAM_BUILD_S, CPU_ADAM_BUILD_S = 90.0, 30.0, 90.0, 60.0
CHAT_PREPARE_S = 20.0  # scripts/demo-sft's conversations, built and prepared (--chat) once
HOST_ADAM_BYTES_PER_S = 4e9  # DeepSpeedCPUAdam over 16 bytes per parameter per step


def flops_per_token(recipe: str, seq: int) -> tuple[float, int]:
    from dstrain.model.config import GPTConfig, flops_per_token, num_params

    model = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["model"]
    config = GPTConfig(**{"vocab_size": 4096, **model, "max_seq_len": seq})
    return flops_per_token(config, seq), num_params(config)


def run_s(dry: bool, recipe: str, seq: int, micro: int, steps: int, offload: bool = False) -> float:
    flops, params = flops_per_token(recipe, seq)
    step = 0.05 if dry else flops * micro * seq / (BF16_PEAK * ASSUMED_MFU)
    host_adam = 16 * params / HOST_ADAM_BYTES_PER_S if offload else 0.0
    return RUN_START_S[dry] + 10 * params / 1e9 + steps * (step + host_adam)


def speed_s(dry: bool, plan: tuple, steps: int) -> float:
    recipe, seq, micros, variants = plan
    compiles = sum(COMPILE_S for v in variants if v == "compile")
    return len(variants) * run_s(dry, recipe, seq, 2 * micros[0], steps) + (0 if dry else compiles)


def memory_s(dry: bool, recipe: str, micro: int, seq: int, configs: list[str]) -> float:
    offloads = [c for c in configs if "offload" in c]
    runs = sum(run_s(dry, recipe, seq, micro, MEMORY_STEPS, offload="offload" in c) for c in configs)
    return runs + (CPU_ADAM_BUILD_S if offloads and not dry else 0.0)


@dataclass
class Part:
    name: str
    run: Callable[[parts.Check], list[dict]]
    estimate_s: float
    columns: list[str]
    title: str


VERDICT = ["check", "ok", "detail"]
SPEED = ["recipe", "variant", "seq_len", "micro_batch", "tokens_per_s", "tflops_per_device", "mfu", "mem_peak_gib"]
SPEED += ["status"]
PROFILE = ["recipe", "wall_ms_per_step", "kernel_ms_per_step", "outside_kernels_ms_per_step", "launches_per_step"]
PROFILE += ["kernel", "count", "ms", "share"]
MEMORY = ["recipe", "ds_config", "micro_batch", "seq_len", "measured_gib", "estimated_gib", "error", "status"]


def plan_parts(dry: bool) -> list[Part]:
    """Every part, in priority order, with its estimate for this mode (a dry run: toy sizes on a CPU)."""
    steps = DRY_STEPS if dry else None
    s125, s13 = (DRY_SPEED, DRY_SPEED) if dry else (SPEED_125M, SPEED_1_3B)
    mem_configs = ["zero1.json"] if dry else MEMORY_CONFIGS
    speed_steps, precision_steps, memory_steps = steps or SPEED_STEPS, steps or PRECISION_STEPS, 2 if dry else 5
    profile_steps = 5 if dry else PROFILE_STEPS  # 3 profiled after the warm-up
    recipes = ["tiny"] if dry else ["tiny", "gpt2-125m", "gpt-1.3b"]
    tiny = run_s(dry, "tiny", 128, 16, precision_steps)
    result = [
        Part(
            "profile_gpt2_125m",
            lambda c: parts.profile(c, s125[0], s125[1], s125[2][0], profile_steps),
            run_s(dry, s125[0], s125[1], 2 * s125[2][0], profile_steps),
            PROFILE,
            "Where gpt2-125m's step time goes (torch.profiler over 3 steps, eager, zero1_bf16)",
        ),
        Part(
            "speed_gpt2_125m",
            lambda c: parts.speed(c, *s125, speed_steps),
            speed_s(dry, s125, speed_steps),
            SPEED,
            "Speed and MFU of gpt2-125m (bf16, zero1_bf16, world of one; eager and compile)",
        ),
        Part(
            "loss_chunking",
            lambda c: features.loss_chunking(c, precision_steps, None if dry else SPEED_125M),
            2 * tiny + (0 if dry else speed_s(dry, (*SPEED_125M[:3], ["eager"]), speed_steps)),
            VERDICT + SPEED[:2] + SPEED[4:8],
            "The fused chunked loss against whole (tiny, fp32), then gpt2-125m with the loss whole (speed, memory)",
        ),
        Part(
            "speed_gpt_1_3b",
            lambda c: parts.speed(c, *s13, speed_steps),
            speed_s(dry, s13, speed_steps),
            SPEED,
            "Speed and MFU of gpt-1.3b (bf16, zero1_bf16, world of one; eager and compile)",
        ),
        Part(
            "precision",
            lambda c: parts.precision(c, precision_steps),
            (2 if dry else 4) * tiny + (0 if dry else FUSED_ADAM_BUILD_S),
            VERDICT,
            "bf16 and fp16 with FusedAdam against fp32 torch AdamW (tiny, world of one)",
        ),
    ]
    for recipe, micro, seq in MEMORY_MODELS:
        sized = DRY_MEMORY if dry else (recipe, micro, seq)
        result.append(
            Part(
                f"memory_{recipe.replace('-', '_').replace('.', '_')}",
                lambda c, sized=sized: parts.memory(c, *sized, mem_configs, memory_steps),
                memory_s(dry, *sized, mem_configs),
                MEMORY,
                f"Peak device memory of {sized[0]} against `dstrain estimate`",
            )
        )
    if dry:  # memory_* share one code path; in a dry run (toy sizes) the first stands for all
        result = [p for p in result if p.name not in ("speed_gpt_1_3b", "memory_gpt2_350m", "memory_gpt_1_3b")]
    return result + feature_parts(dry, tiny, precision_steps) + checks(dry, tiny, precision_steps, recipes)


def feature_parts(dry: bool, tiny: float, steps: int) -> list[Part]:
    """This round's features on a GPU path (bench/gpu_features.py), after the headline figures."""
    return [
        Part(
            "moe_recompute",
            lambda c: features.moe_recompute(c, steps, not dry),
            (2 if dry else 4) * tiny,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "A mixture of experts with activation checkpointing against without (tiny-moe, fp32; bf16 speed)",
        ),
        Part(
            "windowed_attention",
            lambda c: features.windowed_attention(c, steps),
            tiny if dry else 3 * tiny + FLEX_COMPILE_S,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "Sliding windows and sinks: FlexAttention (GPU) against the dense mask (CPU), speed against full attention",
        ),
        Part(
            "sft_loss",
            lambda c: features.sft_loss(c, steps),
            CHAT_PREPARE_S + (1 if dry else 2) * tiny,
            VERDICT,
            "Instruction tuning's masked loss: GPU against CPU (tiny on scripts/demo-sft's conversations, fp32)",
        ),
    ]


def checks(dry: bool, tiny: float, steps: int, recipes: list[str]) -> list[Part]:
    """The parts after the features: CUDA tests, document masking, a published family, every strategy's
    correctness, kernels and FLOP accounting."""
    masking_speed = None if dry else SPEED_125M
    return [
        Part("pytest_gpu", parts.cuda_tests, 30.0 if dry else 150.0, VERDICT, "CUDA tests (pytest -m gpu)"),
        Part(
            "doc_masking",
            lambda c: parts.doc_masking(c, steps, masking_speed),
            tiny + (0 if dry else tiny + FLEX_COMPILE_S + speed_s(dry, (*SPEED_125M[:3], ["eager"]), SPEED_STEPS)),
            VERDICT + SPEED[:2] + SPEED[4:7],
            "Document masking inside training (FlexAttention on a GPU)",
        ),
        Part(
            "published_family",
            lambda c: parts.published_family(c, DRY_STEPS if dry else SPEED_STEPS),
            tiny if dry else run_s(dry, "continue-qwen3-0.6b", 2048, 16, SPEED_STEPS),
            SPEED,
            "A published family's architecture at its size: Qwen3-0.6B, random weights, eager (zero1_bf16)",
        ),
        Part(
            "correctness",
            lambda c: parts.correctness(c, steps),
            (2 if dry else 7) * tiny,
            VERDICT,
            "Every ZeRO stage, offload and FusedAdam (fp32) against ZeRO-0 (tiny, world of one)",
        ),
        Part(
            "attention",
            lambda c: parts.attention(c, recipes),
            10.0 if dry else 40.0,
            ["recipe", "doc_masking", "kernel"],
            "Attention kernels (bf16 forward)",
        ),
        Part(
            "flops",
            lambda c: parts.flop_count(c, recipes),
            10.0 if dry else 40.0,
            ["recipe", "ours_per_token", "deepspeed_per_token", "ratio"],
            "FLOPs per token: ours against DeepSpeed's profiler",
        ),
    ]


def setup_environment(work: Path, wheels: Path | None) -> dict:
    """PYTHONPATH for every run: the repository's src, then the unpacked wheels (never over the machine's torch)."""
    paths = [str(ROOT / "src")]
    if wheels and any(wheels.glob("*.whl")):
        site = work / "site"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        subprocess.run([*pip, "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
        paths.append(str(site))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HUB_OFFLINE="1",
        NVIDIA_TF32_OVERRIDE="0",
        PYTHONUNBUFFERED="1",
    )
    sys.path[:0] = paths
    return env


def ensure_data(data: Path, env: dict) -> None:
    """The demo corpus, prepared as scripts/demo does; carried to the GPU machine, so made there only if missing."""
    if (data / "manifest.json").exists():
        return
    raw = ROOT / "data" / "raw" / "pydocs.jsonl"
    subprocess.run([sys.executable, "-m", "dstrain.data.corpus", str(raw)], env=env, check=True)
    prepare = ["prepare", "--dataset", str(raw), "--train-tokenizer", "4096", "--out", str(data)]
    subprocess.run([sys.executable, "-m", "dstrain", *prepare], env=env, check=True)


def machine() -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "accelerator": get_accelerator().device_name(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return info


def read_done(path: Path | None) -> dict:
    """{part: its entry} of the parts an earlier loan measured; a file not there yet means none."""
    if path is None:
        return {}
    if not path.exists():
        print(f"--skip-done {path}: not there yet, so no part was measured before", flush=True)
        return {}
    try:
        earlier = json.loads(path.read_text())
        entries = earlier["parts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"gpu_check: error: --skip-done {path}: not a gpu_check.json ({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(2) from None
    when = earlier.get("started", "?")
    return {
        name: {**entry, "measured": entry.get("measured", when)}
        for name, entry in entries.items()
        if entry.get("status") == "done"
    }


def calibration(done: dict, dry_run: bool) -> float:
    """Measured over estimated seconds of the parts an earlier loan ran: the factor for this loan's estimates."""
    timed = [e for e in done.values() if e.get("seconds") and e.get("estimated_s")]
    if dry_run or not timed:
        return 1.0
    scale = sum(e["seconds"] for e in timed) / sum(e["estimated_s"] for e in timed)
    print(f"estimates x {scale:.2f}: measured over estimated seconds of the {len(timed)} parts done before", flush=True)
    return scale


def print_plan(plan: list[Part], done: dict, budget_s: float | None) -> None:
    print(f"plan ({'no budget' if budget_s is None else f'budget {budget_s:.0f} s'}), in priority order:", flush=True)
    total = 0.0
    for part in plan:
        if part.name in done:
            print(f"  {part.name:<18} done on {done[part.name]['measured']}: skipped", flush=True)
            continue
        total += part.estimate_s
        print(f"  {part.name:<18} ~{part.estimate_s:5.0f} s   (cumulative ~{total:.0f} s)", flush=True)


def run_part(part: Part, check: parts.Check) -> dict:
    started = time.monotonic()
    try:
        entry = {"status": "done", "rows": part.run(check)}
    except parts.Skipped as e:
        entry = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # a broken part must not cost the loan the parts after it
        (check.work / "logs" / f"{part.name}.error.log").write_text(traceback.format_exc())
        entry = {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        check.failures.append(f"{part.name}: {entry['reason']}")
    entry.update(seconds=round(time.monotonic() - started, 1), estimated_s=round(part.estimate_s))
    return entry


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.md, gpu_check.json and logs.tar.gz")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds this command may take in all")
    parser.add_argument("--skip-done", type=Path, default=None, help="an earlier gpu_check.json: skip what it measured")
    parser.add_argument("--parts", nargs="+", default=None, help="only these parts (default: all, in priority order)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheelhouse from scripts/gpu-wheels")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "pydocs", help="prepared corpus (made if missing)")
    parser.add_argument("--work", type=Path, default=None, help="run folders, configs, logs (default: a temp folder)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on any device (CI runs this on a CPU)")
    args = parser.parse_args()
    plan = plan_parts(args.dry_run)
    unknown = sorted(set(args.parts or []) - {p.name for p in plan})
    if unknown:
        parser.error(f"--parts {' '.join(unknown)}: no such part; choose from {' '.join(p.name for p in plan)}")
    plan = [p for p in plan if args.parts is None or p.name in args.parts]
    done = read_done(args.skip_done)
    scale = calibration(done, args.dry_run)
    for part in plan:
        part.estimate_s *= scale
    print_plan(plan, done, args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dstrain-gpu-check-"))
    check = parts.Check(args.out, work, args.data, args.dry_run, setup_environment(work, args.wheels))
    ensure_data(args.data, check.env)
    figures = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "machine": machine(),
        "parts": {},
    }
    for part in plan:
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
        if part.name in done:
            figures["parts"][part.name] = done[part.name]
        elif left is not None and part.estimate_s > left:
            reason = f"estimated {part.estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left"
            figures["parts"][part.name] = {"status": "skipped", "reason": reason, "estimated_s": round(part.estimate_s)}
        else:
            figures["parts"][part.name] = run_part(part, check)
        write_report(args.out, work, figures, plan, check.failures)  # after every part: a cut-off command keeps it
        entry = figures["parts"][part.name]
        print(f"{part.name}: {entry['status']} ({entry.get('reason') or str(entry.get('seconds')) + ' s'})", flush=True)
    print((args.out / "gpu_check.md").read_text())
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
