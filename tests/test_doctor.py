"""`dstrain doctor`: the strategies against ZeRO-0 on this machine. It passes on the pinned DeepSpeed, fails naming the
strategy when ZeRO-2's gradient reduction is patched into a silent defect (one bucket of two scaled, the class of
deepspeedai/DeepSpeed#7718), and says in one line why a strategy cannot run here."""

import argparse
import json
import subprocess
import sys

import pytest

from ranks import run_ranks
from train_helpers import ROOT, ds_config, small_recipe

BUCKET = 20_000  # reduce_bucket_size of the defect's ZeRO-2: the small model's gradients fill several buckets


def doctor_args(recipe, out, *configs) -> argparse.Namespace:
    return argparse.Namespace(
        recipe=str(recipe), deepspeed_configs=[str(c) for c in configs], nproc=2, steps=10, out=out, overrides=[]
    )


def run_with_defect(runs: list[dict], defective: str) -> dict:
    """Rank target: each run of doctor's plan in one process group; ``defective``'s with DeepSpeed ZeRO-2's
    average_tensor patched to double every other bucket's gradients (a silent defect: nothing raises)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from dstrain.train.doctor.runs import run_one

    codes = {}
    average = DeepSpeedZeroOptimizer.average_tensor
    calls = [0]

    def scaled_every_other(self, tensor, communication_data_type):
        calls[0] += 1
        if calls[0] % 2:
            tensor.mul_(2.0)
        return average(self, tensor, communication_data_type)

    for run in runs:
        if run["name"] == defective:
            DeepSpeedZeroOptimizer.average_tensor = scaled_every_other
        codes[run["name"]] = run_one(run)
        DeepSpeedZeroOptimizer.average_tensor = average
    return codes


@pytest.mark.distributed
def test_doctor_fails_naming_a_strategy_with_a_silent_gradient_defect(tmp_path, corpus, capsys):
    from dstrain.commands.doctor import prepare
    from dstrain.commands.doctor_report import build_report

    recipe = small_recipe(tmp_path, corpus, model={"doc_masking": True})
    bucketed = ds_config(tmp_path, "zero2", zero_optimization={"stage": 2, "reduce_bucket_size": BUCKET})
    buckets, defective = tmp_path / "zero2_buckets.json", tmp_path / "zero2_patched.json"
    buckets.write_text(bucketed.read_text())
    defective.write_text(bucketed.read_text())
    out = tmp_path / "doctor"
    _, runs, refused, _, _ = prepare(doctor_args(recipe, out, ROOT / "ds_configs" / "zero2.json", buckets, defective))
    runs = [run for run in runs if run["name"] != "zero1_then_zero3"]  # the resume check: the launcher test's
    codes = run_ranks(2, run_with_defect, runs, "zero2_patched")
    assert codes[0] == {run["name"]: 0 for run in runs}
    (out / "codes.json").write_text(json.dumps(codes[0]))
    (out / "checks.json").write_text("[]")
    assert build_report(out, runs, refused, {"recipe": str(recipe), "ranks": 2, "steps": 10, "launch": 0}) == 1
    report = json.loads((out / "doctor.json").read_text())
    status = {s["name"]: s for s in report["strategies"]}
    assert status["zero2"]["status"] == "ok" and status[buckets.stem]["status"] == "ok"
    assert status["zero2_patched"]["status"] == "MISMATCH"
    assert status["zero2_patched"]["first_diverging_step"] == 1  # the norm is off from the first step
    assert status["zero2_patched"]["max_norm_rel"] > 0.1
    assert status["zero2"]["max_norm_rel"] <= report["fp32_tolerance"] <= 1e-5
    assert "outside tolerance: zero2_patched" in capsys.readouterr().out
    assert (out / "doctor.png").stat().st_size > 10_000


@pytest.mark.launcher
def test_doctor_on_cpu_from_the_command_line(tmp_path, corpus):
    """The whole command as a user runs it: one deepspeed launch, the refusals as lines, exit 0 on the pinned
    DeepSpeed (the kernel checks and the resume across layouts included)."""
    recipe = small_recipe(tmp_path, corpus, model={"doc_masking": True})
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": ')
    configs = ["zero2", "zero3", "sp2_zero1", "zero1_fp16", "pp4_zero1_bf16"]
    out = tmp_path / "doctor"
    command = [sys.executable, "-m", "dstrain", "doctor", "--recipe", str(recipe), "--out", str(out)]
    command += ["--deepspeed_configs", *[str(ROOT / "ds_configs" / f"{c}.json") for c in configs], str(broken)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + (out / "launcher.log").read_text()[-3000:]
    report = json.loads((out / "doctor.json").read_text())
    status = {s["name"]: s for s in report["strategies"]}
    for name in ("zero2", "zero3", "sp2_zero1", "zero1_then_zero3"):
        assert status[name]["status"] == "ok", status[name]
    for name in ("zero1_fp16", "pp4_zero1_bf16", "broken"):
        assert status[name]["status"] == "cannot run here" and status[name]["reason"], name
        assert "\n" not in status[name]["reason"]
    assert {c["name"] for c in report["checks"]} >= {"fused optimizer", "attention", "chunked loss"}
    assert all(c["ok"] for c in report["checks"])
    assert "| `zero2` | fp32 | ok |" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "name", ["tiny", "continue-gemma3-1b", "continue-qwen3-30b-a3b", "continue-gpt-oss-20b", "gpt2-125m"]
)
def test_doctor_model_keeps_the_recipes_family_at_a_small_size(name, corpus):
    """Each shipped family's features survive doctor's shrink as a valid recipe (windows, MoE, tying, q/k norms)."""
    from dstrain.commands.doctor import small_model
    from dstrain.recipe_file import load_recipe

    data = [f"data.sources=[{{path: {corpus}}}]", "data.stages=[]", "init_from=null"]
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", data)
    small = load_recipe(ROOT / "recipes" / f"{name}.yaml", [*data, *small_model(recipe)])
    assert (small.model.n_layer, small.model.d_model, small.data.seq_len) == (2, 64, 32)
    assert small.model.flavour == recipe.model.flavour and small.model.tied == recipe.model.tied
    assert (small.model.moe is None) == (recipe.model.moe is None)
    assert (small.model.sliding_window is None) == (recipe.model.sliding_window is None)
    assert small.model.qk_norm == recipe.model.qk_norm and small.init_from is None


def test_a_strategy_that_cannot_run_here_is_one_line(tmp_path, corpus):
    from dstrain.commands.doctor import refusal, small_model
    from dstrain.recipe_file import load_recipe

    recipe = small_recipe(tmp_path, corpus)
    overrides = small_model(load_recipe(recipe))
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": ')
    for config in (broken, ROOT / "ds_configs" / "zero1_fp16.json", ROOT / "ds_configs" / "pp4_zero1_bf16.json"):
        why = refusal(str(recipe), config, overrides, 2)
        assert why and "\n" not in why and "Traceback" not in why, (config, why)
    assert refusal(str(recipe), ROOT / "ds_configs" / "zero2.json", overrides, 2) is None
