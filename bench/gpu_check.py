"""dstrain on one GPU, in one command: correctness, memory against `dstrain estimate`, speed, attention kernels.

    python3 bench/gpu_check.py OUT [--wheels .whl] [--parts correctness memory speed attention]
    .venv/bin/python bench/gpu_check.py OUT --dry-run      (CPU, toy sizes: the same code paths, for CI)

Installs nothing over the machine's torch: wheels from --wheels (built by `scripts/gpu-wheels`) are unpacked into
OUT/site and put on the path of every run. Each training run is `python -m dstrain.train` as a world of one in
its own process (its own peak memory, an OOM costs only that run) on the demo corpus (prepared if missing).
Writes OUT/gpu_check.md (the tables) and OUT/gpu_check.json (every figure); exit 1 if a correctness check fails.

Tolerances: fp32 ZeRO 0-3, FusedAdam and CPU offload agree with ZeRO-0 within 1e-5 relative per step (TF32
off); bf16 (fp32 accumulation) within 1e-2 of fp32; fp16 within 2e-2, with fewer than a quarter of steps skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "ds_configs"
# train.tasks off: the recipes' Hub task datasets cannot be reached from the GPU machine, and are not measured here
QUIET = ["train.eval_interval=1000000", "train.checkpoint_interval=1000000", "train.eval_samples=16", "train.tasks=[]"]

# Memory: (recipe, micro-batch, sequence length) x ds_configs, 5 steps each.
MEMORY_MODELS = [("gpt2-125m", 8, 1024), ("gpt2-350m", 8, 1024), ("gpt-1.3b", 2, 2048)]
MEMORY_CONFIGS = [
    "zero0.json",
    "zero1_bf16.json",
    "zero2_bf16.json",
    "zero3_bf16.json",
    "zero2_offload.json",
    "zero3_offload.json",
]
# Speed: (recipe, sequence length, micro-batches to try, largest first; variants).
SPEED_PLAN = [
    ("gpt2-125m", 1024, [32, 16, 8], ["base", "compile", "doc_masking"]),
    ("gpt2-350m", 1024, [16, 8, 4], ["base"]),
    ("gpt-1.3b", 2048, [8, 4, 2], ["base", "compile", "checkpointing"]),
]
# The dry run (CI, CPU): every code path once at toy size; torch.compile is left to the GPU (minutes on 2 cores).
DRY = {
    "models": [("tiny", 2, 64)],
    "memory_configs": ["zero1.json"],
    "speed": [("tiny", 64, [4, 2], ["base"])],
    "correctness": ["zero0", "zero3"],
    "steps": 4,
}


PARTS = ["cuda_tests", "correctness", "attention", "flops", "memory", "speed"]


class Check:
    """Runs, figures and verdicts of one invocation."""

    def __init__(self, out: Path, runs: Path, data: Path, dry_run: bool, env: dict):
        self.out, self.runs, self.data, self.dry_run, self.env = out, runs, data, dry_run, env
        self.figures: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": dry_run}
        self.failures: list[str] = []

    def train(self, name: str, recipe: str, config: Path | dict, overrides: list[str], steps: int) -> dict:
        """One world-of-one training run; returns its status, log tail and metrics records."""
        run_dir = self.runs / name
        if isinstance(config, dict):
            path = self.out / "configs" / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(config, indent=2))
            config = path
        command = [
            sys.executable,
            "-m",
            "dstrain.train",
            "--recipe",
            str(ROOT / "recipes" / f"{recipe}.yaml"),
            "--deepspeed_config",
            str(config),
            "--resume",
            "none",
            f"run_dir={run_dir}",
            f"data.sources=[{{path: {self.data}}}]",
            f"train.steps={steps}",
            "train.log_interval=1",
            f"schedule.warmup_steps={max(1, steps // 4)}",
            *QUIET,
            *overrides,
        ]
        started = time.monotonic()
        done = subprocess.run(command, env=self.env, capture_output=True, text=True)
        log = done.stdout + done.stderr
        (self.out / "logs").mkdir(exist_ok=True)
        (self.out / "logs" / f"{name}.log").write_text(" ".join(command) + "\n\n" + log)
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        steps_logged = [r for r in records if "loss" in r and "split" not in r and "event" not in r]
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1.3B model's final checkpoint is 18 GB
        return {
            "rc": done.returncode,
            "seconds": round(time.monotonic() - started, 1),
            "records": steps_logged,
            "oom": "out of memory" in log.lower() or "OutOfMemoryError" in log,
            "tail": log.strip().splitlines()[-3:],
        }

    def verdict(self, what: str, ok: bool, detail: str) -> dict:
        if not ok:
            self.failures.append(f"{what}: {detail}")
        return {"check": what, "ok": ok, "detail": detail}


def setup_environment(out: Path, wheels: Path | None) -> dict:
    """PYTHONPATH for every run: the repository's src, then the unpacked wheels (never over the machine's torch)."""
    paths = [str(ROOT / "src")]
    if wheels and any(wheels.glob("*.whl")):
        site = out / "site"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--upgrade",
                "--target",
                str(site),
                *map(str, sorted(wheels.glob("*.whl"))),
            ],
            check=True,
        )
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
    if (data / "manifest.json").exists():
        return
    raw = ROOT / "data" / "raw" / "pydocs.jsonl"
    subprocess.run([sys.executable, "-m", "dstrain.data.corpus", str(raw)], env=env, check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dstrain",
            "prepare",
            "--dataset",
            str(raw),
            "--train-tokenizer",
            "4096",
            "--out",
            str(data),
        ],
        env=env,
        check=True,
    )


def machine() -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    info = {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "accelerator": get_accelerator().device_name(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return info


def losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["records"]]


def worst_relative(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def correctness(check: Check, steps: int) -> list[dict]:
    """The tiny recipe under every precision and ZeRO stage, against ZeRO-0 fp32."""
    plan = {
        "zero0": "zero0.json",
        "zero1": "zero1.json",
        "zero2": "zero2.json",
        "zero3": "zero3.json",
        "fusedadam": "zero1_fusedadam.json",
        "zero2_offload": "zero2_offload.json",
    }
    if not check.dry_run:
        plan |= {
            "zero1_bf16": "zero1_bf16.json",
            "zero2_bf16": "zero2_bf16.json",
            "zero3_bf16": "zero3_bf16.json",
            "zero1_fp16": "zero1_fp16.json",
            "zero2_fp16": "zero2_fp16.json",
        }
    if check.dry_run:
        plan = {name: plan[name] for name in DRY["correctness"]}
    runs = {name: check.train(f"correct-{name}", "tiny", CONFIGS / config, [], steps) for name, config in plan.items()}
    check.figures["correctness_runs"] = {
        n: {
            "rc": r["rc"],
            "seconds": r["seconds"],
            "losses": losses(r),
            "grad_norm": [x.get("grad_norm") for x in r["records"]],
            "loss_scale": [x.get("loss_scale") for x in r["records"]],
        }
        for n, r in runs.items()
    }
    reference = losses(runs["zero0"])
    rows = []
    for name, run in runs.items():
        if name == "zero0":
            continue
        error = worst_relative(losses(run), reference)
        tolerance = 1e-2 if "bf16" in name else 2e-2 if "fp16" in name else 1e-5
        detail = f"max relative loss difference to zero0 fp32 {error:.2e} (tolerance {tolerance:g})"
        if run["rc"] != 0:
            detail = f"exit {run['rc']}: {' | '.join(run['tail'])}"
        if "fp16" in name and run["records"]:
            skipped = run["records"][-1].get("skipped_steps") or 0
            scales = sorted({x["loss_scale"] for x in run["records"] if x.get("loss_scale")})
            detail += f"; {skipped} of {steps} steps skipped; scales seen {scales}"
            error = error if skipped < steps / 4 else float("inf")
        rows.append(check.verdict(name, run["rc"] == 0 and error <= tolerance, detail))
    return rows


def memory(check: Check, models, configs, steps: int) -> list[dict]:
    """Measured peak device memory over a few steps beside `dstrain estimate`'s device peak, world of one."""
    from dstrain.config import load_recipe
    from dstrain.strategy.memory import estimate_file

    rows = []
    for recipe_name, micro, seq in models:
        recipe_file = ROOT / "recipes" / f"{recipe_name}.yaml"
        overrides = [f"data.seq_len={seq}", f"train.global_batch={micro}"]
        for config_name in configs:
            config = json.loads((CONFIGS / config_name).read_text()) | {"train_micro_batch_size_per_gpu": micro}
            path = check.out / "configs" / f"mem-{recipe_name}-{config_name}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(config))
            recipe = load_recipe(recipe_file, overrides + [f"data.sources=[{{path: {check.data}}}]"])
            est = estimate_file(recipe, recipe_file, path, 1, 1)
            run = check.train(f"mem-{recipe_name}-{Path(config_name).stem}", recipe_name, path, overrides, steps)
            measured = max((r.get("mem_peak_bytes") or 0 for r in run["records"]), default=0)
            estimated = est.peak("device")
            rows.append(
                {
                    "recipe": recipe_name,
                    "ds_config": config_name,
                    "micro_batch": micro,
                    "seq_len": seq,
                    "measured_gib": round(measured / 2**30, 2),
                    "estimated_gib": round(estimated / 2**30, 2),
                    "error": round(estimated / measured - 1, 3) if measured else None,
                    "parts_gib": {
                        p.name: round(max(p.step, p.backward) / 2**30, 3) for p in est.parts if p.where == "device"
                    },
                    "status": "ok" if run["rc"] == 0 else ("OOM" if run["oom"] else f"exit {run['rc']}"),
                }
            )
    return rows


def speed_config(variant: str, micro: int) -> dict:
    config = json.loads((CONFIGS / "zero1_bf16.json").read_text()) | {"train_micro_batch_size_per_gpu": micro}
    if variant == "compile":
        config["compile"] = {}  # dstrain calls engine.compile() when the ds_config has this section
    if variant == "checkpointing":
        config["activation_checkpointing"] = {}  # every block recomputes its activations in the backward
    return config


def speed(check: Check, plan, steps: int) -> list[dict]:
    """tokens/s, TFLOP/s and MFU per recipe (bf16, ZeRO-1): the largest micro-batch that runs, then its variants."""
    rows = []
    for recipe_name, seq, micros, variants in plan:
        chosen = None
        for variant in variants:
            for micro in [chosen] if chosen else micros:
                extra = ["model.doc_masking=true"] if variant == "doc_masking" else []
                overrides = [
                    f"data.seq_len={seq}",
                    f"train.global_batch={2 * micro}",
                    "schedule.warmup_steps=1",
                    *extra,
                ]
                run = check.train(
                    f"speed-{recipe_name}-{variant}-mb{micro}",
                    recipe_name,
                    speed_config(variant, micro),
                    overrides,
                    steps,
                )
                if run["rc"] == 0 or not run["oom"]:
                    break
            chosen = chosen or micro
            timed = run["records"][
                len(run["records"]) // 3 :
            ]  # after start-up, compilation and the allocator's warm-up
            row = {
                "recipe": recipe_name,
                "variant": variant,
                "seq_len": seq,
                "micro_batch": micro,
                "status": "ok" if run["rc"] == 0 else ("OOM" if run["oom"] else f"exit {run['rc']}"),
            }
            for key in ("tokens_per_s", "tflops_per_device", "mfu"):
                values = [r[key] for r in timed if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
            row["mem_peak_gib"] = round(
                max((r.get("mem_peak_bytes") or 0 for r in run["records"]), default=0) / 2**30, 2
            )
            rows.append(row)
    return rows


def attention(check: Check, recipes: list[str]) -> list[dict]:
    """Which scaled-dot-product-attention kernel each recipe dispatches (bf16), read off the profiler's op names."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from dstrain.config import load_recipe
    from dstrain.model.gpt import GPT

    device = get_accelerator().current_device_name()
    dtype = torch.bfloat16
    kinds = {"flash": "flash", "efficient": "memory-efficient", "cudnn": "cudnn", "math": "math"}
    rows = []
    for name in recipes:
        for doc_masking in (False, True):
            recipe = load_recipe(
                ROOT / "recipes" / f"{name}.yaml",
                [f"data.sources=[{{path: {check.data}}}]", f"model.doc_masking={str(doc_masking).lower()}"],
            )
            config = recipe.model
            model = GPT(config).to(device=device, dtype=dtype)
            length = min(recipe.data.seq_len, 256 if check.dry_run else recipe.data.seq_len)
            tokens = torch.randint(0, config.vocab_size, (1, length), device=device)
            positions = torch.arange(length, device=device).remainder(length // 2)[None]  # two documents
            with torch.no_grad(), torch.profiler.profile() as prof:
                model(tokens, positions)
            ops = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}
            used = sorted({label for key, label in kinds.items() for op in ops if key in op})
            rows.append(
                {"recipe": name, "doc_masking": doc_masking, "kernel": ", ".join(used) or "none", "ops": sorted(ops)}
            )
            del model
    return rows


def flop_count(check: Check, recipes: list[str]) -> list[dict]:
    """The trainer's FLOPs per token against DeepSpeed's flops profiler (forward x 3 for forward + backward)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.profiling.flops_profiler import get_model_profile

    from dstrain.config import load_recipe
    from dstrain.model.config import flops_per_token
    from dstrain.model.gpt import GPT

    rows = []
    for name in recipes:
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", [f"data.sources=[{{path: {check.data}}}]"])
        length = recipe.data.seq_len
        model = GPT(recipe.model).to(get_accelerator().current_device_name())
        tokens = torch.zeros(1, length, dtype=torch.long, device=get_accelerator().current_device_name())
        forward, _, _ = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)
        ours = flops_per_token(recipe.model, length)
        rows.append(
            {
                "recipe": name,
                "ours_per_token": ours,
                "deepspeed_per_token": 3 * forward / length,
                "ratio": round(ours / (3 * forward / length), 4),
            }
        )
        del model
    return rows


def cuda_tests(check: Check) -> list[dict]:
    """tests/test_gpu.py (FusedAdam, fused attention, the ZeRO-0 fp16 defect on CUDA); a CPU skips them, saying why."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        cwd=ROOT,
        env=check.env,
        capture_output=True,
        text=True,
    )
    (check.out / "logs").mkdir(exist_ok=True)
    (check.out / "logs" / "test_gpu.log").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return [check.verdict("tests/test_gpu.py", done.returncode in (0, 5) and "failed" not in summary, summary)]


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(check: Check) -> None:
    f = check.figures
    parts = [
        f"# dstrain GPU check ({'dry run, CPU' if check.dry_run else f.get('machine', {}).get('device', '?')})",
        "",
        "```",
        json.dumps(f.get("machine", {})),
        "```",
    ]
    sections = [
        ("cuda_tests", "CUDA-only tests", ["check", "ok", "detail"]),
        ("correctness", "Correctness (tiny recipe, world of one)", ["check", "ok", "detail"]),
        ("attention", "Attention kernels (bf16 forward)", ["recipe", "doc_masking", "kernel"]),
        (
            "flops",
            "FLOPs per token: ours against DeepSpeed's profiler",
            ["recipe", "ours_per_token", "deepspeed_per_token", "ratio"],
        ),
        (
            "memory",
            "Peak device memory against `dstrain estimate`",
            ["recipe", "ds_config", "micro_batch", "seq_len", "measured_gib", "estimated_gib", "error", "status"],
        ),
        (
            "speed",
            "Speed (bf16, ZeRO-1, world of one)",
            [
                "recipe",
                "variant",
                "seq_len",
                "micro_batch",
                "tokens_per_s",
                "tflops_per_device",
                "mfu",
                "mem_peak_gib",
                "status",
            ],
        ),
    ]
    for key, title, columns in sections:
        if key in f:
            parts += ["", f"## {title}", "", table(f[key], columns)]
    if check.failures:
        parts += ["", "## Failures", ""] + [f"- {x}" for x in check.failures]
    (check.out / "gpu_check.md").write_text("\n".join(parts) + "\n")
    (check.out / "gpu_check.json").write_text(json.dumps(f, indent=1, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.md, gpu_check.json, logs/ and runs/")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheelhouse from scripts/gpu-wheels")
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "pydocs", help="prepared corpus (made if missing)")
    parser.add_argument(
        "--runs", type=Path, default=None, help="run folders, deleted after each run (default: OUT/runs)"
    )
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on any device (CI runs this on a CPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per correctness run (default 20; dry run 4)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(
        args.out, args.runs or args.out / "runs", args.data, args.dry_run, setup_environment(args.out, args.wheels)
    )
    ensure_data(args.data, check.env)
    check.figures["machine"] = machine()
    steps = args.steps or (DRY["steps"] if args.dry_run else 20)
    recipes = ["tiny"] if args.dry_run else ["tiny", "gpt2-125m", "gpt-1.3b"]
    work = {
        "cuda_tests": lambda: cuda_tests(check),
        "correctness": lambda: correctness(check, steps),
        "attention": lambda: attention(check, recipes),
        "flops": lambda: flop_count(check, recipes),
        "memory": lambda: memory(
            check,
            DRY["models"] if args.dry_run else MEMORY_MODELS,
            DRY["memory_configs"] if args.dry_run else MEMORY_CONFIGS,
            5 if not args.dry_run else 2,
        ),
        "speed": lambda: speed(check, DRY["speed"] if args.dry_run else SPEED_PLAN, steps if args.dry_run else 30),
    }
    for part in args.parts:
        started = time.monotonic()
        check.figures[part] = work[part]()
        check.figures[f"{part}_seconds"] = round(time.monotonic() - started, 1)
        write_report(check)  # after every part: a command cut off by its time limit still leaves what it measured
        print(f"{part}: {check.figures[f'{part}_seconds']} s", flush=True)
    print((args.out / "gpu_check.md").read_text())
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
