"""The training console (train/process/console.py) and the run's picture (train/plot.py), in-process and cheap; the
end-to-end checks ride on tests/test_train.py's launcher runs."""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from dstrain.run_dir import RunDir
from dstrain.train.plot import plot_run, try_plot_run
from dstrain.train.process import console

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


def test_a_plotting_failure_is_a_warning(tmp_path, capsys):
    assert try_plot_run(RunDir(tmp_path / "no-run")) is None
    err = capsys.readouterr().err
    assert re.fullmatch(r"dstrain: warning: could not draw .*loss\.png: FileNotFoundError: .*\n", err)


def test_every_warning_a_run_prints_is_one_dstrain_line(tmp_path, capsys, monkeypatch):
    """A damaged checkpoint passed over at resume (said by rank 0 only), a disk short of keep_last+1 checkpoints, a
    stale op-build lock, a loss picture that cannot be drawn: one ``dstrain: warning:`` line each, on the console
    and in the rank's log; no path into dstrain's code, no source line, no Python warning category."""
    from dstrain.train import preflight, run_folder
    from dstrain.train.engine import build as engine

    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "global_step2").mkdir(parents=True)  # published, but its record is gone
    (checkpoints / "latest").write_text("global_step2")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    (tmp_path / "ops" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "ops" / "cpu_adam" / "lock").touch()
    old = time.time() - engine.STALE_BUILD_LOCK_S - 60
    os.utime(tmp_path / "ops" / "cpu_adam" / "lock", (old, old))
    monkeypatch.setattr("dstrain.model.counts.num_params", lambda model: 2**30)  # 16 GiB a checkpoint
    monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda path: SimpleNamespace(free=20 * 2**30))
    recipe = SimpleNamespace(model=None, train=SimpleNamespace(keep_last=2))
    console.start(False)
    try:
        monkeypatch.setenv("RANK", "1")
        assert preflight.resume_tag(checkpoints, "auto") is None
        assert capsys.readouterr().err == ""  # rank 1 finds it too, and says nothing
        monkeypatch.setenv("RANK", "0")
        console.open_log(RunDir(tmp_path / "run"), rank=0)
        assert preflight.resume_tag(checkpoints, "auto") is None
        run_folder.check_disk(tmp_path / "run", recipe)
        assert engine.warn_stale_build_locks() == [tmp_path / "ops" / "cpu_adam" / "lock"]
        try_plot_run(RunDir(tmp_path / "no-run"))
    finally:
        console.end()
    err = capsys.readouterr().err
    expected = [
        r"checkpoint .*global_step2 is damaged, skipping it: .*dstrain_checkpoint\.json is missing or unreadable",
        r"run_dir .*run: 20\.0 GiB free holds fewer than train\.keep_last\+1 checkpoints",
        r".*cpu_adam/lock is 31 minutes old: a killed build of a DeepSpeed op left it, .*; if nothing is compiling, "
        r"remove it",
        r"could not draw .*loss\.png: FileNotFoundError: .*",
    ]
    lines = err.splitlines()
    assert len(lines) == len(expected), err
    for line, pattern in zip(lines, expected):
        assert re.fullmatch("dstrain: warning: " + pattern, line), line
    assert "Warning:" not in err and ".py:" not in err
    assert all(line in (tmp_path / "run" / "logs" / "rank0.log").read_text() for line in lines)


def test_dstrain_raises_no_python_warnings():
    """dstrain's warnings go through dstrain.errors.warn (one line); warnings.warn would print a path and a line of
    our source, and drop repeats by call site."""
    src = Path(__file__).resolve().parents[1] / "src" / "dstrain"
    found = [
        f"{p}:{n}"
        for p in src.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bwarnings\.warn(_explicit)?\(", line)
    ]
    assert not found, found


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
        # a library's warning raised (by its stacklevel) at a line of dstrain's is still the library's
        warnings.warn_explicit("a warning at our line", UserWarning, console.__file__, 1)
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
    assert "a warning at our line" in log
    hidden = ["early info", "a deepspeed warning", "a torch warning", "a library's warning", "a warning at our line"]
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
