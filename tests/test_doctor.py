"""`dstrain doctor`: the strategies against ZeRO-0 on this machine. It passes on the pinned DeepSpeed from the command
line, says in one line why a strategy cannot run here, plans every strategy at accumulation >= 2, sets per-step
tolerances from the twin, and warns when the installed DeepSpeed is in a known-bad range. The injected defects:
tests/test_doctor_defects.py."""

import json
import math
import subprocess
import sys

import pytest

from train_helpers import ROOT, small_recipe


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
    for name in ("zero2", "zero2_acc2", "zero3", "sp2_zero1", "zero1_then_zero3"):
        assert status[name]["status"] == "ok", status[name]
    for name in ("zero1_fp16", "pp4_zero1_bf16", "broken"):
        assert status[name]["status"] == "cannot run here" and status[name]["reason"], name
        assert "\n" not in status[name]["reason"]
    assert {c["name"] for c in report["checks"]} >= {"fused optimizer", "attention", "chunked loss"}
    assert all(c["ok"] for c in report["checks"])
    report_text = (out / "report.md").read_text()
    assert "| `zero2` | fp32 | 1 | ok |" in report_text and "| `zero2_acc2` | fp32 | 2 | ok |" in report_text
    assert status["zero3_acc2"]["status"] == "ok" and status["sp2_zero1"]["accumulation"] == 2
    assert {row["name"]: row["status"] for row in report["gradient_checks"]} == {
        "ranks agree": "ok",
        "reported norm": "ok",
        "accumulation": "ok",
        "tied parameter": "n/a",  # no ZeRO-2 in half precision listed
    }
    import deepspeed
    import torch

    assert f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}" in report_text


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
    from dstrain.commands.doctor import small_model
    from dstrain.commands.doctor_plan import refusal
    from dstrain.recipe_file import load_recipe

    recipe = small_recipe(tmp_path, corpus)
    overrides = small_model(load_recipe(recipe))
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": ')
    for config in (broken, ROOT / "ds_configs" / "zero1_fp16.json", ROOT / "ds_configs" / "pp4_zero1_bf16.json"):
        why = refusal(str(recipe), config, overrides, 2)
        assert why and "\n" not in why and "Traceback" not in why, (config, why)
    assert refusal(str(recipe), ROOT / "ds_configs" / "zero2.json", overrides, 2) is None


def test_every_strategy_is_planned_at_accumulation_two_beside_its_shipped_path(tmp_path, corpus):
    """Data-parallel layouts get a copy at half the micro-batch (accumulation 2) beside the shipped one (1); layouts
    that accumulate as shipped (SP2, PP2 on 2 ranks) run once; --quick keeps only the accumulating runs; each
    precision has its baseline and twin, and a ZeRO-2 half-precision config brings the tied-head pair."""
    from dstrain.commands.doctor import small_model
    from dstrain.commands.doctor_plan import plan_runs
    from dstrain.recipe_file import load_recipe

    recipe = small_recipe(tmp_path, corpus)
    overrides = small_model(load_recipe(recipe))
    configs = [ROOT / "ds_configs" / f"{name}.json" for name in ("zero2", "pp2_zero1", "zero2_bf16", "zero2_fp16")]
    runs, refused, _ = plan_runs(str(recipe), configs, tmp_path / "full", overrides, 2, 10)
    planned = {run["name"]: run for run in runs}
    assert {name: planned[name]["accumulation"] for name in ("zero2", "zero2_acc2", "pp2_zero1")} == {
        "zero2": 1,
        "zero2_acc2": 2,
        "pp2_zero1": 2,
    }
    assert "pp2_zero1_acc2" not in planned and planned["zero2_bf16_acc2"]["baseline"] == "zero1_bf16"
    assert planned["zero0_reordered"]["accumulation"] == 2 and planned["zero1_bf16_reordered"]["role"] == "twin"
    assert planned["zero2_bf16_tied"]["baseline"] == "zero1_bf16_tied" and planned["zero2_bf16_tied"]["role"] == "tied"
    assert "model.tie_embeddings=true" in planned["zero2_bf16_tied"]["argv"]
    assert "no fp16" in refused["zero2_fp16"] and "no fp16" in refused["zero2_fp16_tied"]
    with_micro = json.loads((tmp_path / "full" / "configs" / "zero2_acc2.json").read_text())
    assert with_micro["train_micro_batch_size_per_gpu"] == 2
    quick, _, _ = plan_runs(str(recipe), configs[:1], tmp_path / "quick", overrides, 2, 10, quick=True)
    assert [run["name"] for run in quick] == ["zero0", "zero0_reordered", "zero2_acc2"]


def test_accumulating_micro_batch():
    from dstrain.commands.doctor_plan import accumulating_micro_batch

    assert accumulating_micro_batch(8, 2, 4) == 2  # 4 samples per replica: 2 micro-batches of 2
    assert accumulating_micro_batch(16, 2, 4) == 4  # tiny.yaml at its own size already accumulates 2 x 4
    assert accumulating_micro_batch(12, 2, 6) == 3
    assert accumulating_micro_batch(8, 8, 1) is None  # one sample per replica cannot accumulate


def test_per_step_tolerance_follows_the_twin_so_a_sharp_step_passes_and_a_defect_fails():
    """tiny.yaml at its own size: ZeRO-0 at micro-batch 2 jumps 8.7e-6 at step 7 (1e-7 elsewhere), ZeRO-2 1.3e-5 at
    step 7 and SP2 1.4e-5 at step 8: within 10 x the twin over the neighbouring steps. A fixed 1e-5 failed them; a
    2e-5 difference on a quiet step, or a defect's 0.2, still fails."""
    from dstrain.commands.doctor_report import compare, per_step_tolerances

    drift = [1e-7, 2e-7, 1e-7, 3e-7, 1.6e-6, 2e-7, 8.7e-6, 3e-7, 1e-7, 1e-7]
    tolerances = per_step_tolerances(drift, "fp32")
    assert tolerances[6] == pytest.approx(8.7e-5) and tolerances[7] == pytest.approx(8.7e-5)  # steps 7 and 8
    assert tolerances[2] == pytest.approx(3e-6) and tolerances[4] == pytest.approx(1.6e-5) and tolerances[9] == 1e-6
    reference = [{"loss": 5.0, "grad_norm": 1.0} for _ in drift]

    def run(**off):  # {step: relative difference of the norm}
        return [{"loss": 5.0, "grad_norm": 1.0 + off.get(f"s{i}", 0.0)} for i in range(1, 11)]

    assert compare("zero2", "", run(s7=1.3e-5), reference, tolerances).status == "ok"
    assert compare("sp2_zero1", "", run(s8=1.4e-5), reference, tolerances).status == "ok"
    assert compare("fixed", "", run(s7=1.3e-5), reference, [1e-5] * 10).status == "MISMATCH"
    quiet = compare("defect", "", run(s3=2e-5), reference, tolerances)
    assert (quiet.status, quiet.first_diverging_step) == ("MISMATCH", 3)
    assert compare("defect", "", run(s1=0.2), reference, tolerances).first_diverging_step == 1
    assert per_step_tolerances([1e-4], "bf16") == [2e-3] and per_step_tolerances([1e-3], "bf16") == [3e-3]
    assert math.isnan(per_step_tolerances([1e-7, math.nan], "fp32")[0])  # a twin gone NaN fails its neighbours too
    assert compare("x", "", run(), reference, [math.nan] * 10).status == "MISMATCH"


def test_the_installed_deepspeed_in_a_known_bad_range_is_one_warning_line():
    """The typed catalogue: DeepSpeed 0.18.0 under ZeRO-2 is #7718's range; 0.19.0 with bf16 ZeRO-2 and a tied head
    is #8224's; the pinned 0.19.8 is in neither; a bug whose features no run uses warns of nothing."""
    from dstrain.commands.doctor_catalogue import CATALOGUE, features_of, markdown_table, warnings

    runs = [
        {"name": "zero2_acc2", "config": str(ROOT / "ds_configs" / "zero2.json"), "accumulation": 2},
        {"name": "zero2_bf16_tied", "config": str(ROOT / "ds_configs" / "zero2_bf16.json"), "role": "tied"},
        {"name": "zero1", "config": str(ROOT / "ds_configs" / "zero1.json"), "accumulation": 1},
    ]
    used = features_of(runs, tied_recipe=False)
    assert used["zero2"] == ["zero2_acc2", "zero2_bf16_tied"] and used["tied"] == ["zero2_bf16_tied"]
    old = warnings("0.18.0", used)
    assert len(old) == 1 and "deepspeedai/DeepSpeed#7718" in old[0] and "zero2_acc2" in old[0] and "\n" not in old[0]
    bf16 = warnings("0.19.0", used)
    assert len(bf16) == 1 and "#8224" in bf16[0] and "(zero2_bf16_tied)" in bf16[0]
    assert warnings("0.19.8", used) == []
    assert warnings("0.18.0", features_of(runs[2:], tied_recipe=True)) == []  # no ZeRO-2: #7718 does not bite
    documented = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert "\n".join(markdown_table()) in documented  # docs/troubleshooting.md prints the typed table as it is
    assert len(CATALOGUE) >= 5
