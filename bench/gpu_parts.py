"""The measurements of bench/gpu_check.py, one function per part; each returns its rows (verdicts or figures).

Each training run is bench/gpu_train.py (the trainer without its final checkpoint) as a world of one in its own
process (its own peak memory; an OOM costs only that run), on the demo corpus; a dry run forks it from a process
that imported the trainer once.

Tolerances: fp32 ZeRO 1-3 and CPU offload agree with ZeRO-0 within 1e-5 relative per step, FusedAdam (fp32) with
torch's AdamW likewise (TF32 off); bf16 (fp32 accumulation) within 1e-2 of fp32; fp16 within 2e-2, with fewer than
a quarter of steps skipped; FlexAttention document masking on the GPU within 1e-4 of the dense mask on the CPU.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "ds_configs"
# train.tasks off: the recipes' Hub task datasets cannot be reached from the GPU machine, and are not measured there
QUIET = ["train.eval_interval=1000000", "train.checkpoint_interval=1000000", "train.eval_samples=16", "train.tasks=[]"]
DRY_SIZE = ["data.seq_len=64", "train.global_batch=4"]  # a dry run's tiny runs: one micro-batch of 4 per step


class Skipped(Exception):
    """A part that cannot run here, and why (the report says so; not a failure)."""


class Check:
    """Runs, verdicts and where they go: ``work`` holds run folders, configs and logs; ``out`` what comes back."""

    def __init__(self, out: Path, work: Path, data: Path, dry_run: bool, env: dict):
        self.out, self.work, self.data, self.dry_run, self.env = out, work, data, dry_run, env
        self.failures: list[str] = []
        (work / "logs").mkdir(parents=True, exist_ok=True)
        (work / "configs").mkdir(parents=True, exist_ok=True)

    def config_file(self, name: str, config: dict) -> Path:
        path = self.work / "configs" / f"{name}.json"
        path.write_text(json.dumps(config, indent=2))
        return path

    def train(self, name: str, recipe: str, config: Path, overrides: list[str], steps: int, env=None) -> dict:
        """One world-of-one training run; returns its status, log tail and metrics records."""
        run_dir = self.work / "runs" / name
        command = [
            sys.executable,
            str(ROOT / "bench" / "gpu_train.py"),
            "--recipe",
            str(ROOT / "recipes" / f"{recipe}.yaml"),
            "--deepspeed_config",
            str(config),
            "--resume",
            "none",
            f"run_dir={run_dir}",
            f"data.sources=[{{path: {self.data}}}]",
            f"train.steps={steps}",
            "train.tokens=null",  # the cluster recipes give their length in tokens; a check's length is its steps
            "train.log_interval=1",
            f"schedule.warmup_steps={max(1, steps // 4)}",
            *QUIET,
            *(DRY_SIZE if self.dry_run else []),
            *overrides,
        ]
        started = time.monotonic()
        if self.dry_run:  # forked from a process that imported the trainer once (bench/gpu_train.py)
            from gpu_train import run_forked

            returncode, log = run_forked(command[2:], {**self.env, **(env or {})})
        else:
            done = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True, text=True)
            returncode, log = done.returncode, done.stdout + done.stderr
        (self.work / "logs" / f"{name}.log").write_text(" ".join(command) + "\n\n" + log)
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        shutil.rmtree(run_dir, ignore_errors=True)
        return {
            "rc": returncode,
            "seconds": round(time.monotonic() - started, 1),
            "records": [r for r in records if "loss" in r and "split" not in r and "event" not in r],
            "oom": "out of memory" in log.lower() or "OutOfMemoryError" in log,
            "tail": log.strip().splitlines()[-3:],
        }

    def verdict(self, what: str, ok: bool, detail: str, **figures) -> dict:
        if not ok:
            self.failures.append(f"{what}: {detail}")
        return {"check": what, "ok": ok, "detail": detail, **figures}


def status(run: dict) -> str:
    return "ok" if run["rc"] == 0 else ("OOM" if run["oom"] else f"exit {run['rc']}")


def peak_gib(run: dict) -> float:
    """The run's peak device memory over its logged steps, GiB."""
    return round(max((r.get("mem_peak_bytes") or 0 for r in run["records"]), default=0) / 2**30, 2)


def losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["records"]]


def worst_relative(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def grad_norms(run: dict) -> list[float]:
    return [r.get("grad_norm") or 0.0 for r in run["records"]]


def compare(check: Check, name: str, run: dict, reference: dict, tolerance: float, steps: int) -> dict:
    """A run's losses and pre-clip gradient norms against a reference run's, step by step."""
    loss_error = worst_relative(losses(run), losses(reference))
    norm_error = worst_relative(grad_norms(run), grad_norms(reference))
    detail = f"max relative difference: loss {loss_error:.2e}, grad norm {norm_error:.2e} (tolerance {tolerance:g})"
    ok = run["rc"] == 0 and loss_error <= tolerance
    if run["rc"] != 0:
        detail = f"exit {run['rc']}: {' | '.join(run['tail'])}"
    if "fp16" in name and run["records"]:
        skipped = run["records"][-1].get("skipped_steps") or 0
        scales = sorted({x["loss_scale"] for x in run["records"] if x.get("loss_scale")})
        detail += f"; {skipped} of {steps} steps skipped; loss scales {scales}"
        ok = ok and skipped < steps / 4
    return check.verdict(name, ok, detail, losses=losses(run), grad_norms=grad_norms(run), seconds=run["seconds"])


def speed_config(variant: str, micro: int) -> dict:
    config = json.loads((CONFIGS / "zero1_bf16.json").read_text()) | {"train_micro_batch_size_per_gpu": micro}
    if variant == "compile":
        config["compile"] = {}  # dstrain calls engine.compile() when the ds_config has this section
    if variant == "loss_whole":
        config["tiling"] = {"loss": 1}  # the default ("auto") chunks gpt2-125m's loss at these micro-batches
    if variant == "checkpointing":
        config["activation_checkpointing"] = {}  # every block recomputes its activations in the backward
    return config


def speed(
    check: Check, recipe: str, seq: int, micros: list[int], variants: list[str], steps: int, more: tuple = ()
) -> list[dict]:
    """tokens/s, TFLOP/s and MFU (bf16, ZeRO-1): the largest micro-batch that runs, then the other variants at it;
    ``more``: overrides of the recipe for every run."""
    rows, chosen = [], None
    for variant in variants:
        for micro in [chosen] if chosen else micros:
            extra = ["model.doc_masking=true"] if variant == "doc_masking" else []
            overrides = [f"data.seq_len={seq}", f"train.global_batch={2 * micro}", *extra, *more]
            name = f"speed-{recipe}-{variant}-mb{micro}"
            run = check.train(name, recipe, check.config_file(name, speed_config(variant, micro)), overrides, steps)
            if run["rc"] == 0 or not run["oom"]:
                break
        chosen = chosen or micro
        timed = run["records"][len(run["records"]) // 3 :]  # after start-up, compilation and the allocator's warm-up
        row = {"recipe": recipe, "variant": variant, "seq_len": seq, "micro_batch": micro, "status": status(run)}
        for key in ("tokens_per_s", "tflops_per_device", "mfu"):
            values = [r[key] for r in timed if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["mem_peak_gib"] = peak_gib(run)
        row["seconds"] = run["seconds"]
        if run["rc"] != 0:
            check.failures.append(f"{name}: {status(run)}: {' '.join(run['tail'])[-300:]}")
        rows.append(row)
    return rows


def profile(check: Check, recipe: str, seq: int, micro: int, steps: int) -> list[dict]:
    """Where a step's time goes (bf16, zero1_bf16, eager): torch.profiler over 3 steps after the warm-up
    (bench/gpu_train.py's ProfileSteps): device time in kernels, time outside them, launches, the top kernels."""
    name = f"profile-{recipe}"
    out = check.work / f"{name}.json"
    overrides = [f"data.seq_len={seq}", f"train.global_batch={2 * micro}"]
    env = {"GPU_TRAIN_PROFILE": str(out), "GPU_TRAIN_PROFILE_FROM": str(steps - 3)}
    run = check.train(name, recipe, check.config_file(name, speed_config("eager", micro)), overrides, steps, env)
    if run["rc"] != 0 or not out.exists():
        check.failures.append(f"{name}: {status(run)}: {' '.join(run['tail'])[-300:]}")
        return [{"recipe": recipe, "status": status(run)}]
    report = json.loads(out.read_text())
    summary = {"recipe": recipe, "micro_batch": micro, **{k: v for k, v in report.items() if k != "top"}}
    return [summary] + [{"recipe": "", **row} for row in report["top"]]


def fused_adam_build(check: Check) -> dict:
    """FusedAdam's JIT build with this machine's nvcc (the one thing compiled there): its time, or why not."""
    code = (
        "from dstrain.train.engine.build import make_arch_list_readable_by_deepspeed as fix; fix(); "
        "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=check.env, capture_output=True, text=True)
    (check.work / "logs" / "fused_adam_build.log").write_text(done.stdout + done.stderr)
    detail = f"{time.monotonic() - started:.0f} s (cached in ~/.cache/torch_extensions for the later runs)"
    if done.returncode != 0:
        detail = f"exit {done.returncode}: {' | '.join(done.stderr.strip().splitlines()[-2:])}"
    return check.verdict("FusedAdam JIT build", done.returncode == 0, detail, seconds=round(time.monotonic() - started))


def precision(check: Check, steps: int) -> list[dict]:
    """bf16 and fp16 with FusedAdam (DeepSpeed's AdamW on a GPU) against fp32 with torch's AdamW, on tiny."""

    def with_optimizer(base: str, torch_adam: bool) -> dict:
        config = json.loads((CONFIGS / base).read_text())
        config["optimizer"]["params"]["torch_adam"] = torch_adam
        return config

    plan = {
        "fp32 torch AdamW": with_optimizer("zero1.json", True),
        "fp32 FusedAdam": with_optimizer("zero1.json", False),
        "bf16 FusedAdam": with_optimizer("zero1_bf16.json", False),
        "fp16 FusedAdam": with_optimizer("zero1_fp16.json", False),
    }
    if check.dry_run:  # a CPU has neither FusedAdam nor fp16: the code path with what it has
        plan = {
            "fp32 torch AdamW": plan["fp32 torch AdamW"],
            "bf16 torch AdamW": with_optimizer("zero1_bf16.json", True),
        }
    rows = [] if check.dry_run else [fused_adam_build(check)]
    runs = {}
    for name, config in plan.items():
        slug = name.replace(" ", "-")
        runs[name] = check.train(f"precision-{slug}", "tiny", check.config_file(f"precision-{slug}", config), [], steps)
    reference = runs.pop("fp32 torch AdamW")
    for name, run in runs.items():
        tolerance = 1e-2 if "bf16" in name else 2e-2 if "fp16" in name else 1e-5
        rows.append(compare(check, name, run, reference, tolerance, steps))
    return rows


def memory(check: Check, recipe_name: str, micro: int, seq: int, configs: list[str], steps: int) -> list[dict]:
    """Measured peak device memory over a few steps beside `dstrain estimate`'s device peak, world of one."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.plan.memory import estimate_file

    rows = []
    recipe_file = ROOT / "recipes" / f"{recipe_name}.yaml"
    overrides = [f"data.seq_len={seq}", f"train.global_batch={micro}"]
    for config_name in configs:
        config = json.loads((CONFIGS / config_name).read_text()) | {"train_micro_batch_size_per_gpu": micro}
        name = f"mem-{recipe_name}-{Path(config_name).stem}"
        path = check.config_file(name, config)
        recipe = load_recipe_and_source(recipe_file, overrides + [f"data.sources=[{{path: {check.data}}}]"])[0]
        est = estimate_file(recipe, path, 1, 1)
        run = check.train(name, recipe_name, path, overrides, steps)
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
                "status": status(run),
                "seconds": run["seconds"],
            }
        )
        if run["rc"] != 0:
            check.failures.append(f"{name}: {status(run)}: {' '.join(run['tail'])[-300:]}")
    return rows


def cuda_tests(check: Check) -> list[dict]:
    """`pytest -m gpu` (FusedAdam, fused attention, the ZeRO-0 fp16 defect on CUDA, ...); a CPU skips them. A dry
    run collects tests/test_gpu.py alone (they live there), not the whole suite."""
    where = str(ROOT / "tests" / "test_gpu.py") if check.dry_run else "tests"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", where],
        cwd=ROOT,
        env=check.env,
        capture_output=True,
        text=True,
    )
    (check.work / "logs" / "pytest_gpu.log").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return [check.verdict("pytest -m gpu", done.returncode in (0, 5) and "failed" not in summary, summary)]


def doc_masking(check: Check, steps: int, speed_plan: tuple | None) -> list[dict]:
    """Document masking inside training: FlexAttention's block mask on the GPU against the dense mask on the CPU
    (the same tiny run, fp32), then its speed on gpt2-125m beside the speed part's eager row."""
    import torch

    config = check.config_file("doc-masking-zero1", json.loads((CONFIGS / "zero1.json").read_text()))
    flex = check.train("doc-masking-device", "tiny", config, ["model.doc_masking=true"], steps)
    if not torch.cuda.is_available():
        rows = [check.verdict("doc masking, this device", flex["rc"] == 0, f"{status(flex)}; no CUDA: dense mask only")]
    else:
        cpu = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        dense = check.train("doc-masking-cpu", "tiny", config, ["model.doc_masking=true"], steps, env=cpu)
        rows = [compare(check, "FlexAttention (GPU) vs dense mask (CPU)", flex, dense, 1e-4, steps)]
    if speed_plan:
        recipe, seq, micros, _ = speed_plan
        rows += speed(check, recipe, seq, micros, ["doc_masking"], 30)
    return rows


def published_family(check: Check, steps: int) -> list[dict]:
    """Qwen3-0.6B's own architecture (per-head q/k norms, head_dim apart from d_model / n_head, tied embeddings) at its
    published size, from random weights on the demo corpus: speed and MFU under zero1_bf16, eager. A dry run shrinks
    it to the same features at toy size."""
    seq, micros, shrink = 2048, [8, 4], []
    if check.dry_run:
        seq, micros = 64, [2]
        shrink = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_head=32"]
        shrink += ["model.d_ff=128", "model.vocab_size=4096"]
    more = ["init_from=null", *shrink]  # random weights
    return speed(check, "continue-qwen3-0.6b", seq, micros, ["eager"], steps, more)


def correctness(check: Check, steps: int) -> list[dict]:
    """The tiny recipe under every ZeRO stage, CPU offload and FusedAdam (fp32), against ZeRO-0."""
    plan = ["zero0", "zero1", "zero2", "zero3", "zero1_fusedadam", "zero2_offload", "zero3_offload"]
    if check.dry_run:
        plan = ["zero0", "zero3"]
    runs = {name: check.train(f"correct-{name}", "tiny", CONFIGS / f"{name}.json", [], steps) for name in plan}
    reference = runs.pop("zero0")
    return [compare(check, name, run, reference, 1e-5, steps) for name, run in runs.items()]


def attention(check: Check, recipes: list[str]) -> list[dict]:
    """Which scaled-dot-product-attention kernel each recipe dispatches (bf16), read off the profiler's op names."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.gpt import GPT

    device = get_accelerator().current_device_name()
    kinds = {"flash": "flash", "efficient": "memory-efficient", "cudnn": "cudnn", "math": "math"}
    rows = []
    for name in recipes:
        for masking in (False, True):
            recipe = load_recipe_and_source(
                ROOT / "recipes" / f"{name}.yaml",
                [f"data.sources=[{{path: {check.data}}}]", f"model.doc_masking={str(masking).lower()}"],
            )[0]
            model = GPT(recipe.model).to(device=device, dtype=torch.bfloat16)
            length = min(recipe.data.seq_len, 256 if check.dry_run else recipe.data.seq_len)
            tokens = torch.randint(0, recipe.model.vocab_size, (1, length), device=device)
            positions = torch.arange(length, device=device).remainder(length // 2)[None]  # two documents
            with torch.no_grad(), torch.profiler.profile() as prof:
                model(tokens, positions)
            ops = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "flex" in e.key}
            used = sorted({label for key, label in kinds.items() for op in ops if key in op})
            rows.append(
                {"recipe": name, "doc_masking": masking, "kernel": ", ".join(used) or "none", "ops": sorted(ops)}
            )
            del model
    return rows


def flop_count(check: Check, recipes: list[str]) -> list[dict]:
    """The trainer's FLOPs per token against DeepSpeed's flops profiler (forward x 3 for forward + backward)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.profiling.flops_profiler import get_model_profile

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.model.counts import flops_per_token
    from dstrain.model.gpt import GPT

    rows = []
    for name in recipes:
        recipe = load_recipe_and_source(ROOT / "recipes" / f"{name}.yaml", [f"data.sources=[{{path: {check.data}}}]"])[
            0
        ]
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
