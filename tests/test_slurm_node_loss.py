"""A node that dies: the job keeps its allocation and relaunches (slurm/train.sbatch, dstrain.train.process.elastic),
on the
Slurm cluster of tests/slurm_cluster.py. After tests/test_slurm.py (pytest runs the modules in name order): these
tests kill a node's slurmd, and start it again before they end."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from slurm_jobs import (
    JOB_TIMEOUT,
    STEPS,
    TRAIN,
    assert_completed,
    log_of,
    restarts_until_gone,
    run_of,
    submit,
    zero,
)
from train_helpers import read_metrics, train_losses

pytestmark = pytest.mark.slurm

CHECKPOINTS = "train.checkpoint_interval=10"  # the most steps a fault can cost
FAULT_BOUND_S = 180  # fault to first step after it: detection (10 s grace), probes, a relaunch on 2 busy cores


def progress(run) -> tuple[int, list[dict]]:
    """The last train step metrics.jsonl holds and its events."""
    from train_helpers import read_events

    steps = [r["step"] for r in read_metrics(run) if "split" not in r] if (run / "metrics.jsonl").exists() else []
    return (steps[-1] if steps else 0), (read_events(run) if steps else [])


def wait_for(cluster, work, job: int, event: str | None, steps_after: int, timeout: float = JOB_TIMEOUT) -> None:
    """Until ``event`` is in metrics.jsonl (None: right away) and ``steps_after`` more steps were logged after it."""
    run, deadline, start = run_of(work, job), time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        step, events = progress(run)
        seen = [e for e in events if e["event"] == event]
        if event is None or seen:
            start = 0 if event is None else seen[-1]["step"]
            if step >= start + steps_after:
                return
        if cluster.job_state(job) in (None, "FAILED", "CANCELLED", "COMPLETED"):
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job}: no {event} then {steps_after} steps\n{log_of(work, job)}\n{cluster.logs_tail()}")


def signal_rank(cluster, job: int, rank: int, sig) -> None:
    pids = cluster.trainer_ranks(job, rank)
    assert pids, f"rank {rank} of job {job} not found"
    for pid in pids:
        os.kill(pid, sig)


def relaunches(run) -> list[dict]:
    """The relaunch events on the dashboards' path (metrics.jsonl), the same as summary.json's "restarts"."""
    logged = [e for e in progress(run)[1] if e["event"] in ("restart", "spare", "shrink", "requeue")]
    assert logged == json.loads((run / "summary.json").read_text())["restarts"]
    return logged


def test_a_failed_rank_restarts_in_place_and_a_lost_node_shrinks_the_world(slurm_cluster, work, one_node_two_tasks):
    """2 nodes x 1 rank: rank 1 killed -> the same world restarts in place; then dsnode2's slurmd and tasks killed ->
    the job goes on without it, 1 rank accumulating 2 micro-batches, no requeue, the losses of the uninterrupted run."""
    args = ["--nodes=2", "--ntasks-per-node=1", TRAIN, "small.yaml", zero(0), CHECKPOINTS]
    job = submit(slurm_cluster, work, args, wait=False)
    killed = False
    try:
        wait_for(slurm_cluster, work, job, None, 12)  # past the first checkpoint
        signal_rank(slurm_cluster, job, 1, signal.SIGKILL)
        wait_for(slurm_cluster, work, job, "restart", 3)
        slurm_cluster.kill_node("dsnode2", job)
        killed = True
        wait_for(slurm_cluster, work, job, "shrink", 1)
    finally:
        if killed:
            slurm_cluster.restart_node("dsnode2")
    restarts = restarts_until_gone(slurm_cluster, job)
    log, run = log_of(work, job), run_of(work, job)
    assert restarts == 0, f"requeued {restarts} times\n{log}"
    assert_completed(run, STEPS, log)
    events = relaunches(run)
    assert [e["event"] for e in events] == ["restart", "shrink"], log
    restart, shrink = events
    assert (restart["event"], restart["lost"], restart["world"], restart["accumulation"]) == ("restart", {}, 2, 1)
    assert shrink["event"] == "shrink" and shrink["lost"] == {"dsnode2": "unreachable"}
    assert (shrink["hosts"], shrink["world"], shrink["accumulation"], shrink["restart"]) == (["dsnode1"], 1, 2, 2)
    for event in (restart, shrink):
        assert 0 <= event["steps_lost"] <= 10 and 0 < event["time_lost_s"] < FAULT_BOUND_S, event
    assert (
        "lost dsnode2 (unreachable); excluded, continuing without: 1 node(s) (dsnode1), world 1, accumulation 2" in log
    )
    # After the shrink, 1 rank x 2 micro-batches of 4 take the uninterrupted 2-rank run's steps (fp32: 1e-5).
    np.testing.assert_allclose(train_losses(run), train_losses(one_node_two_tasks[1]), rtol=0, atol=1e-5)


def test_a_frozen_rank_is_replaced_by_a_spare_and_failures_past_the_cap_requeue(
    slurm_cluster, work, one_node_two_tasks
):
    """2 nodes x 2 ranks, one a spare, at most 1 relaunch: rank 1 SIGSTOPped -> the watchdog names it -> its node
    dsnode1 is left out and the spare takes its place, world unchanged; rank 1 killed again -> past the cap -> the job
    requeues and finishes; the losses are the uninterrupted run's."""
    watchdog = ["train.watchdog.enabled=true", "train.watchdog.floor_s=5", "train.watchdog.ceiling_s=120"]
    options = ["--spare-nodes=1", "--max-restarts", "1"]
    args = ["--nodes=2", "--ntasks-per-node=2", TRAIN, *options, "small.yaml", zero(0), CHECKPOINTS, *watchdog]
    job = submit(slurm_cluster, work, args, wait=False)
    wait_for(slurm_cluster, work, job, None, 12)  # past the first checkpoint
    signal_rank(slurm_cluster, job, 1, signal.SIGSTOP)
    wait_for(slurm_cluster, work, job, "spare", 3)
    signal_rank(slurm_cluster, job, 1, signal.SIGKILL)
    restarts = restarts_until_gone(slurm_cluster, job)
    log, run = log_of(work, job), run_of(work, job)
    assert restarts == 1, f"requeued {restarts} times\n{log}"
    assert_completed(run, STEPS, log)
    events = relaunches(run)
    assert [e["event"] for e in events] == ["spare", "requeue"], log
    spare, requeued = events
    assert spare["event"] == "spare" and spare["lost"] == {"dsnode1": "named by the hang watchdog"}, spare
    assert (spare["hosts"], spare["world"], spare["accumulation"]) == (["dsnode2"], 2, 1)
    assert requeued["event"] == "requeue" and requeued["reason"] == "restart cap reached (1 in this job)"
    assert "spare dsnode2 takes its place: 1 node(s) (dsnode2), world 2" in log and "falling back to a requeue" in log
    np.testing.assert_allclose(train_losses(run), train_losses(one_node_two_tasks[1]), rtol=0, atol=1e-5)
