"""Faults on 2 CPU ranks: nothing lost, nothing hangs. Every fault is injected into a real training run."""

import fcntl
import json
import random
import re
import shutil
import signal
import time

import pytest

from ranks import spawn_ranks, start_ranks
from train_helpers import (
    ROOT,
    read_metrics,
    small_recipe,
    train_and_signal_at,
    train_argv,
    train_losses,
    train_with_fault,
)

pytestmark = pytest.mark.distributed

CONFIG = ROOT / "ds_configs" / "zero1.json"


def wait_all(procs, timeout=240):
    deadline = time.time() + timeout
    outputs = [p.communicate(timeout=max(1, deadline - time.time())) for p in procs]
    return [p.returncode for p in procs], outputs


def wait_for_step(run_dir, step, procs, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists():
            steps = [r["step"] for r in read_metrics(run_dir) if "split" not in r]
            if steps and steps[-1] >= step:
                return
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, corpus):
    return small_recipe(tmp_path_factory.mktemp("reliability"), corpus, train={"checkpoint_interval": 2})


@pytest.fixture(scope="module")
def reference_run(recipe, tmp_path_factory):
    """The uninterrupted run every recovered run must reproduce (read-only: copy it to change it)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    codes, outputs = wait_all(start_ranks(2, train_argv(recipe, CONFIG, run)))
    assert codes == [0, 0], outputs[0][1][-2000:]
    return run


@pytest.fixture(scope="module")
def reference(reference_run):
    return train_losses(reference_run)


def test_kill9_of_the_whole_job_then_resume_is_bit_exact(recipe, reference, tmp_path):
    run = tmp_path / "run"
    kill_after = random.randint(3, 8)
    print(f"killing the job after step {kill_after}")
    procs = start_ranks(2, train_argv(recipe, CONFIG, run))
    wait_for_step(run, kill_after, procs)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    wait_all(procs)
    codes, outputs = wait_all(start_ranks(2, train_argv(recipe, CONFIG, run)))
    assert codes == [0, 0], outputs[0][1][-2000:]
    assert "resumed from global_step" in outputs[0][0]
    assert train_losses(run) == reference  # bit for bit, steps 1..10, no duplicates


def test_a_rank_that_raises_stops_every_rank_within_60s(recipe, tmp_path, capfd):
    start = time.time()
    codes = spawn_ranks(2, train_with_fault, train_argv(recipe, CONFIG, tmp_path / "run"), 3, "raise", 1, timeout=120)
    assert time.time() - start < 60 + 30  # 60 s to notice, plus start-up
    assert codes[0] not in (0, None) and codes[1] not in (0, None), codes
    err = capfd.readouterr().err
    assert "dstrain: rank 1 failed: ValueError: injected fault at step 3" in err


def test_a_killed_rank_stops_the_others_within_60s(recipe, tmp_path):
    run = tmp_path / "run"
    procs = start_ranks(2, train_argv(recipe, CONFIG, run))
    wait_for_step(run, 2, procs)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    procs[0].wait(timeout=60)
    assert time.time() - killed < 60 and procs[0].returncode != 0
    err = procs[0].stderr.read()
    assert (
        "dstrain: rank 0 failed" in err and "Traceback (most recent call last)" in err
    )  # the quiet console hides no error


def test_death_inside_save_keeps_the_previous_checkpoint(recipe, reference, tmp_path):
    run = tmp_path / "run"
    codes = spawn_ranks(2, train_with_fault, train_argv(recipe, CONFIG, run), 4, "die-in-save", None, timeout=180)
    assert codes == [9, 9]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step2"
    assert (checkpoints / "global_step4.partial").is_dir() and not (checkpoints / "global_step4").exists()
    codes, outputs = wait_all(start_ranks(2, train_argv(recipe, CONFIG, run)))
    assert codes == [0, 0], outputs[0][1][-2000:]
    assert "resumed from global_step2" in outputs[0][0]
    assert train_losses(run) == reference
    assert not (checkpoints / "global_step4.partial").exists()  # cleaned up by the next save of step 4


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning(reference_run, tmp_path, capsys):
    from dstrain.checkpoint.store import newest_complete

    checkpoints = shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    assert newest_complete(checkpoints) == "global_step10"
    state = next((checkpoints / "global_step10").glob("*optim_states.pt"))
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # truncated, as by a full disk
    capsys.readouterr()
    assert newest_complete(checkpoints) == "global_step8"
    assert re.fullmatch(
        r"dstrain: warning: checkpoint \S+global_step10 is damaged, skipping it: "
        r".*holds [0-9]+ bytes, its record says.*\n",
        capsys.readouterr().err,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])  # Ctrl-C: tests/test_launchers.py
def test_a_signal_on_any_rank_checkpoints_and_exits_0(recipe, tmp_path, signum):
    run = tmp_path / "run"
    assert spawn_ranks(2, train_and_signal_at, train_argv(recipe, CONFIG, run), 3, signum, 1) == [0, 0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 3
    assert (run / "checkpoints" / "latest").read_text() == "global_step3"


def test_a_signal_delivered_twice_at_once_is_one_request(recipe, tmp_path):
    """A signal to the process group reaches each rank directly and again through its launcher."""
    run = tmp_path / "run"
    assert spawn_ranks(
        2, train_and_signal_at, train_argv(recipe, CONFIG, run), 3, signal.SIGTERM, 0, 2, timeout=120
    ) == [0, 0]
    assert (run / "checkpoints" / "latest").read_text() == "global_step3"


def test_a_second_signal_exits_at_once(recipe, tmp_path):
    from dstrain.train.process.stop import REPEAT_WINDOW_S

    run = tmp_path / "run"
    codes = spawn_ranks(
        2,
        train_and_signal_at,
        train_argv(recipe, CONFIG, run),
        3,
        signal.SIGTERM,
        0,
        2,
        REPEAT_WINDOW_S + 0.5,
        timeout=120,
    )
    assert codes[0] == 128 + signal.SIGTERM and codes[1] != 0
    assert not (run / "checkpoints" / "global_step3").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(recipe, tmp_path, capfd):
    run = tmp_path / "run"
    assert spawn_ranks(2, train_with_fault, train_argv(recipe, CONFIG, run), 5, "nan", None) == [2, 2]
    assert "loss became nan at step 5" in capfd.readouterr().err
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["global_step2", "global_step4"]


def test_two_runs_into_one_run_dir_are_refused(recipe, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running job holds it
        codes, outputs = wait_all(start_ranks(1, train_argv(recipe, CONFIG, run)), timeout=120)
    assert codes == [2]
    assert (
        outputs[0][1].strip().splitlines()[-1]
        == f"dstrain: error: {run} is in use by another run; wait for it or choose another run_dir"
    )
    assert not (run / "recipe.yaml").exists()


# An unwritable run_dir and a disk too small for one checkpoint: tests/test_bad_input.py, in one process.
