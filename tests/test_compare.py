"""dstrain compare: three configs through the real deepspeed launcher, one report; and --collect of existing runs."""

import csv
import json
import os
import statistics

import pytest

from dstrain.commands.cli import main
from dstrain.commands.compare_runs import read_run

from train_helpers import ROOT, read_metrics, small_recipe

pytestmark = pytest.mark.launcher

LOSS_RTOL = 1e-4  # fp32 strategies reduce in different orders: ~1e-7 after 4 steps (see test_train.py)
STEPS = 4


@pytest.fixture(scope="module")
def compared(tmp_path_factory, corpus):
    """zero0 and zero2, 4 steps each on 2 ranks (~1 minute). A config the recipe refuses (a micro-batch that does not
    divide the global batch) stops the comparison before any launch: tests/test_bad_input.py."""
    tmp = tmp_path_factory.mktemp("compare")
    recipe = small_recipe(tmp, corpus)
    configs = [str(ROOT / "ds_configs" / "zero0.json"), str(ROOT / "ds_configs" / "zero2.json")]
    out = tmp / "report"
    argv = [
        "compare",
        "--recipe",
        str(recipe),
        "--deepspeed_configs",
        *configs,
        "optim.lr=2e-3",
        "--nproc",
        "2",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the launched ranks share 2 cores
        code = main(argv)
    return {"out": out, "code": code, "argv": argv, "configs": configs}


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_report_has_a_row_per_config_with_sane_numbers(compared):
    out = compared["out"]
    assert compared["code"] == 0
    rows = read_csv(out / "results.csv")
    assert [r["config"] for r in rows] == ["zero0", "zero2"]
    zero0, zero2 = rows
    for row, stage in [(zero0, "0"), (zero2, "2")]:
        assert row["status"] == "completed" and row["reason"] == ""
        strategy = (row["zero_stage"], row["precision"], row["offload"], row["micro_batch"], row["grad_accum"])
        assert strategy == (stage, "fp32", "none", "4", "1")
        assert row["steps"] == str(STEPS) and row["world_size"] == "2"
        assert (
            float(row["tokens_per_s"]) > 0 and float(row["tflops_per_device"]) > 0 and row["mfu"] == ""
        )  # no CPU peak
        assert float(row["mem_peak_gib"]) > 0 and float(row["est_mem_gib"]) > 0
        assert 4.0 < float(row["final_loss"]) < 8.0 and float(row["valid_loss"]) > 0
    # the same recipe under equivalent strategies: the same final loss, and the difference is reported
    assert float(zero2["final_loss"]) == pytest.approx(float(zero0["final_loss"]), rel=LOSS_RTOL)
    assert float(zero2["loss_diff"]) == pytest.approx(
        float(zero2["final_loss"]) - float(zero0["final_loss"]), abs=1e-12
    )
    assert float(zero0["loss_diff"]) == 0.0


def test_throughput_is_the_median_after_the_first_interval(compared):
    out = compared["out"]
    records = [r for r in read_metrics(out / "zero2") if "split" not in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # compare logs every step
    expected = statistics.median(r["tokens_per_s"] for r in records[1:])
    assert float(read_csv(out / "results.csv")[1]["tokens_per_s"]) == pytest.approx(expected, rel=1e-12)
    report = (out / "report.md").read_text()
    assert "median over the logged intervals after the first" in report


def test_markdown_plots_and_logs(compared):
    out = compared["out"]
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| `")]
    assert len(table) == 2 and "| completed |" in table[0] and "| completed |" in table[1]
    for name in ["loss.png", "throughput.png", "memory.png"]:
        assert f"![{name[:-4]}]({name})" in report
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a real picture, not an empty canvas
    from matplotlib.image import imread

    assert imread(out / "loss.png").shape[:2] == (540, 960)
    for stem in ["zero0", "zero2"]:
        log = (out / stem / "launcher.log").read_text()
        assert log.startswith("$ ") and "--master_port" in log and f"run_dir={out / stem}" in log
    assert f"step {STEPS}/{STEPS}" in (out / "zero0" / "launcher.log").read_text()


def test_collect_rebuilds_the_same_report_without_running(compared, capsys):
    out = compared["out"]
    before = read_csv(out / "results.csv")
    stems = [os.path.splitext(os.path.basename(c))[0] for c in compared["configs"]]
    assert main(["compare", "--collect", str(out), "--deepspeed_configs", *compared["configs"]]) == 0
    assert read_csv(out / "results.csv") == before
    assert main(["compare", "--collect", str(out)]) == 0  # without an order: the run folders, by name
    assert sorted(r["config"] for r in read_csv(out / "results.csv")) == sorted(stems)
    # running into the same folder again is refused before anything is launched
    assert main(compared["argv"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_failures_are_read_from_any_log(tmp_path):
    """A Slurm array's run folders: an OOM traceback, a crash, a run that stopped without a word, an empty folder."""
    oom = tmp_path / "zero1_bf16"
    oom.mkdir()
    (oom / "ds_config.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True},
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 1,
            }
        )
    )
    (oom / "slurm-1234_0.out").write_text(
        'step 10/100 | loss 5.1\nTraceback (most recent call last):\n  File "loop.py", line 1, in fit\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 0 has a total capacity of 79.1 GiB\n"
        "[2026-01-01 00:00:00,000] [ERROR] [launch.py:325:sigkill_handler] ['python', '-u'] "
        "exits with return code = 1\n"
    )
    crash = tmp_path / "zero3"
    crash.mkdir()
    (crash / "launcher.log").write_text("$ deepspeed ...\nRuntimeError: NCCL communicator was aborted on rank 3\n")
    quiet = tmp_path / "zero2"
    quiet.mkdir()
    logged = [
        {"step": 1, "loss": 9.0, "tokens_per_s": 10.0},
        {"step": 2, "loss": 8.9, "tokens_per_s": 30.0},
        {"step": 2, "loss": 8.8, "tokens_per_s": 20.0},
    ]  # requeued: step 2 again after resuming from step 1
    (quiet / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"step": 3, "lo')
    (quiet / "launcher.log").write_text(
        "step 1/100 | loss 9.0\nslurmstepd: *** JOB 7 CANCELLED AT 2026-01-01 DUE TO TIME LIMIT ***\n"
    )

    row = read_run(oom)
    assert row.status == "out of memory" and row.reason.startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert (row.zero_stage, row.precision, row.micro_batch, row.grad_accum, row.world_size) == (1, "bf16", 8, 1, 8)
    row = read_run(crash)
    assert row.status == "crashed" and row.reason == "RuntimeError: NCCL communicator was aborted on rank 3"
    row = read_run(quiet)
    assert row.status == "incomplete" and "DUE TO TIME LIMIT" in row.reason
    assert row.curve == [(1, 9.0), (2, 8.8)] and row.final_loss == 8.8 and row.tokens_per_s == 20.0  # cut line skipped
    assert main(["compare", "--collect", str(tmp_path)]) == 1
    statuses = {r["config"]: r["status"] for r in read_csv(tmp_path / "results.csv")}
    assert statuses == {"zero1_bf16": "out of memory", "zero2": "incomplete", "zero3": "crashed"}
