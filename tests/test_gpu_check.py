"""bench/gpu_check.py's dry run (the GPU check's code paths on a CPU), and the DeepSpeed defect it found."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.launcher
def test_the_gpu_check_dry_run_writes_its_report(tmp_path, corpus):
    out = tmp_path / "check"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            str(out),
            "--dry-run",
            "--data",
            str(corpus),
            "--wheels",
            str(tmp_path / "no-wheels"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((out / "gpu_check.json").read_text())
    assert [row["ok"] for row in figures["correctness"]] == [True]  # ZeRO-3 against ZeRO-0, 1e-5 relative
    (memory,) = figures["memory"]
    assert memory["status"] == "ok" and memory["measured_gib"] > 0 and memory["estimated_gib"] > 0
    (speed,) = figures["speed"]
    assert speed["status"] == "ok" and speed["tokens_per_s"] > 0
    assert figures["flops"][0]["ratio"] == pytest.approx(1.0, abs=1e-3)  # ours against DeepSpeed's profiler
    assert {row["kernel"] for row in figures["attention"]} <= {"flash", "memory-efficient", "cudnn", "math"}
    report = (out / "gpu_check.md").read_text()
    for title in ("Correctness", "Peak device memory", "Speed", "Attention kernels", "FLOPs per token"):
        assert f"## {title}" in report


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

    from dstrain.train.engine import make_arch_list_readable_by_deepspeed

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f+PTX")
    make_arch_list_readable_by_deepspeed()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder.compute_capability_args()  # parses
