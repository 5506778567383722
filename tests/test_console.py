"""The training console (train/console.py) and the run's picture (train/plot.py), in-process and cheap; the
end-to-end checks ride on tests/test_train.py's launcher runs."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from dstrain.run_dir import RunDir
from dstrain.train import console
from dstrain.train.plot import plot_run, try_plot_run

PNG = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_loss_png_of_a_finished_and_of_an_interrupted_run(tmp_path):
    steps = [{"step": s, "loss": 8.0 - s / 10, "lr": 1e-3 * s} for s in range(1, 11)]
    evals = [
        {"step": 5, "split": "valid", "loss": 7.6, "ppl": 2000.0},
        {"step": 10, "split": "valid", "loss": 7.2},
        {"step": 10, "split": "valid/a", "loss": 7.1},
    ]
    write_metrics(tmp_path / "done", [*steps[:5], evals[0], *steps[5:], *evals[1:]])
    # interrupted: no final evaluation, an event record, and a line cut short by a killed job
    write_metrics(
        tmp_path / "stopped",
        [*steps[:3], {"step": 3, "event": "resume", "tag": "global_step3"}],
        tail='{"step": 4, "lo',
    )
    for name in ("done", "stopped"):
        path = plot_run(RunDir(tmp_path / name))
        assert path == tmp_path / name / "loss.png" and path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


def test_a_plotting_failure_is_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="could not draw .*loss.png: FileNotFoundError"):
        assert try_plot_run(RunDir(tmp_path / "no-run")) is None


@pytest.mark.parametrize("verbose", [False, True])
def test_deepspeed_lines_go_to_the_rank_log_and_errors_to_the_console(tmp_path, capsys, verbose):
    deepspeed_logger = logging.getLogger("DeepSpeed")
    level = deepspeed_logger.level
    console.start(verbose)
    try:
        deepspeed_logger.info("early info")  # before the run folder is known: kept in memory
        console.open_log(RunDir(tmp_path), rank=1)
        print("step 1/2 | loss 8.0")
        deepspeed_logger.warning("a deepspeed warning")
        deepspeed_logger.error("a deepspeed error")
        logging.getLogger("torch.somewhere").warning("a torch warning")
        warnings.warn_explicit("a library's warning", FutureWarning, "/site-packages/torch/x.py", 1)
    finally:
        console.end()
    out, err = capsys.readouterr()
    log = (tmp_path / "logs" / "rank1.log").read_text()
    for line in (
        "early info",
        "step 1/2",
        "a deepspeed warning",
        "a deepspeed error",
        "a torch warning",
        "a library's warning",
    ):
        assert line in log
    assert "step 1/2" in out and "a deepspeed error" in err
    hidden = ["early info", "a deepspeed warning", "a torch warning", "a library's warning"]
    assert all((line in out + err) == verbose for line in hidden), out + err
    assert deepspeed_logger.level == (level or logging.WARNING) and not deepspeed_logger.filters


def test_a_rank_failing_before_its_log_opens_prints_what_it_hid(capsys):
    console.start(False)
    logging.getLogger("DeepSpeed").warning("why it failed")
    console.end(error="Traceback ...")
    assert "why it failed" in capsys.readouterr().err


def test_the_verbose_switch_is_a_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    assert console.verbose_requested(["--recipe", "r.yaml", "--verbose"]) and not console.verbose_requested(["a=1"])
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    assert not console.verbose_requested([])
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert console.verbose_requested([])
