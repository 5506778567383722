"""bench/gpu_check.py's dry run (the GPU check's code paths on a CPU), and the DeepSpeed defect it found."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(out: Path, *args: str, corpus: Path | None = None) -> subprocess.CompletedProcess:
    data = ["--data", str(corpus)] if corpus else []
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(out), "--wheels", str(out / "no-wheels")]
    return subprocess.run([*command, *data, *args], capture_output=True, text=True, timeout=900)


@pytest.mark.launcher
def test_the_gpu_check_dry_run_writes_its_report(tmp_path, corpus):
    out = tmp_path / "check"
    done = gpu_check(out, "--dry-run", "--work", str(tmp_path / "work"), corpus=corpus)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # The plan, every part with its estimate, comes before the first part's result.
    plan, _, results = done.stdout.partition("profile_gpt2_125m: done")
    assert results and all(f"  {name}" in plan for name in ("speed_gpt2_125m", "precision", "pytest_gpu", "flops"))
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]
    figures = json.loads((out / "gpu_check.json").read_text())
    parts = figures["parts"]
    assert list(parts) == [
        "profile_gpt2_125m",
        "speed_gpt2_125m",
        "loss_chunking",
        "precision",
        "memory_gpt2_125m",
        "moe_recompute",
        "windowed_attention",
        "latent_attention",
        "sft_loss",
        "chunked_attention",
        "doctor",
        "preference_step",
        "lora",
        "qlora",
        "rl_decode",
        "long_context",
        "pytest_gpu",
        "doc_masking",
        "published_family",
        "correctness",
        "attention",
        "flops",
    ]
    assert {p["status"] for p in parts.values()} == {"done"}
    assert all(p["estimated_s"] > 0 and p["seconds"] >= 0 for p in parts.values())
    assert [row["ok"] for row in parts["precision"]["rows"]] == [True]  # bf16 against fp32, 1e-2 relative
    assert [row["ok"] for row in parts["correctness"]["rows"]] == [True]  # ZeRO-3 against ZeRO-0, 1e-5 relative
    assert [row["ok"] for row in parts["loss_chunking"]["rows"]] == [True]  # chunked against whole, 1e-6 relative
    assert [row["ok"] for row in parts["moe_recompute"]["rows"]] == [True, True]  # recompute vs not, 1e-6 relative
    assert [row["ok"] for row in parts["doc_masking"]["rows"]] == [True]
    assert [row["ok"] for row in parts["windowed_attention"]["rows"]] == [True]  # on a GPU: against the CPU, 1e-4
    assert [row["ok"] for row in parts["sft_loss"]["rows"]] == [True]  # on a GPU: against the CPU, 1e-4
    assert all(row["ok"] for row in parts["lora"]["rows"]) and len(parts["lora"]["rows"]) == 5  # ZeRO-2/3 vs 0, speed
    assert [row["ok"] for row in parts["qlora"]["rows"]] == [True, True]  # NF4 ZeRO-3 vs ZeRO-0 (1e-5), bf16 trains
    assert [row["ok"] for row in parts["latent_attention"]["rows"]] == [True]  # on a GPU: against the CPU, 1e-4
    assert [row["ok"] for row in parts["chunked_attention"]["rows"]] == [True]  # on a GPU: against the CPU, 1e-4
    assert all(row["ok"] for row in parts["doctor"]["rows"]) and len(parts["doctor"]["rows"]) >= 4  # + zero2, twin
    equivalence, speed_ratio = parts["preference_step"]["rows"]  # ZeRO-2 against ZeRO-0, 1e-5; the bench's ratios
    assert equivalence["ok"] and speed_ratio["dpo_over_sft"] > 0 and speed_ratio["reference_over_epoch"] > 0
    (rl,) = parts["rl_decode"]["rows"]  # on a CPU the device is the CPU: greedy tokens equal by construction
    assert rl["ok"] and rl["cached_tokens_per_s"] > 0 and 0 < rl["generation_share"] < 1
    (long,) = parts["long_context"]["rows"]  # host-held checkpoints, chunked loss, tiled MLP: memory vs estimate
    assert long["ok"] and long["estimated_gib"] > 0 and "host_gib" in long  # tiny's host share rounds to 0.00 GiB
    (memory,) = parts["memory_gpt2_125m"]["rows"]
    assert memory["status"] == "ok" and memory["measured_gib"] > 0 and memory["estimated_gib"] > 0
    (speed,) = parts["speed_gpt2_125m"]["rows"]
    assert speed["status"] == "ok" and speed["tokens_per_s"] > 0
    summary, *kernels = parts["profile_gpt2_125m"]["rows"]  # on a CPU: the top ops by self time
    assert summary["wall_ms_per_step"] > 0 and summary["kernel_ms_per_step"] > 0 and kernels and kernels[0]["ms"] > 0
    (family,) = parts["published_family"]["rows"]  # Qwen3's features, shrunk for the dry run
    assert family["recipe"] == "continue-qwen3-0.6b" and family["status"] == "ok" and family["tokens_per_s"] > 0
    assert parts["flops"]["rows"][0]["ratio"] == pytest.approx(1.0, abs=1e-3)  # ours against DeepSpeed's profiler
    assert {row["kernel"] for row in parts["attention"]["rows"]} <= {"flash", "memory-efficient", "cudnn", "math"}
    report = (out / "gpu_check.md").read_text()
    for title in (
        "Speed and MFU of gpt2-125m",
        "bf16 and fp16 with FusedAdam",
        "Peak device memory",
        "FLOPs per token",
    ):
        assert f"## {title}" in report


@pytest.mark.launcher
def test_the_gpu_check_skips_what_was_measured_and_what_does_not_fit(tmp_path, corpus):
    earlier = tmp_path / "earlier.json"
    measured = {"status": "done", "rows": [{"check": "bf16 FusedAdam", "ok": True}], "seconds": 80.0}
    earlier.write_text(json.dumps({"started": "2026-11-30 10:00 UTC", "parts": {"precision": measured}}))
    out = tmp_path / "check"
    args = ["--parts", "precision", "flops", "--skip-done", str(earlier), "--budget-s", "0"]
    done = gpu_check(out, *args, corpus=corpus)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "precision          done on 2026-11-30 10:00 UTC: skipped" in done.stdout
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert parts["precision"] == {**measured, "measured": "2026-11-30 10:00 UTC"}  # carried over whole
    assert parts["flops"]["status"] == "skipped" and "of the budget left" in parts["flops"]["reason"]

    earlier.write_text("{not json")
    refused = gpu_check(out, "--skip-done", str(earlier))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and str(earlier) in refused.stderr


@pytest.mark.deepspeed_defect(
    "op_builder/builder.py cannot sort TORCH_CUDA_ARCH_LIST entries with a suffix "
    "(engine.make_arch_list_readable_by_deepspeed)"
)
def test_deepspeed_cannot_read_arch_suffixes(monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()


def test_the_arch_list_is_made_readable(monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from dstrain.train.engine.build import make_arch_list_readable_by_deepspeed

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f+PTX")
    make_arch_list_readable_by_deepspeed()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder.compute_capability_args()  # parses
