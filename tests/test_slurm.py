"""slurm/train.sbatch and slurm/compare.sbatch, submitted to a real Slurm cluster (tests/slurm_cluster.py).

The cluster has two emulated nodes of 2 CPUs on this machine and no GPUs, so every job asks for
--gpus-per-node=0 --cpus-per-task=1 over the scripts' GPU defaults, as sbatch options do on a real
cluster. Jobs are submitted from a temp folder (their runs/ lands there) with the scripts' absolute
paths, as a user submitting from elsewhere would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from dstrain.data.shards import ShardReader

from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture: one cluster for the whole run)
from train_helpers import ROOT, read_metrics, small_recipe, train_losses

pytestmark = pytest.mark.slurm

TRAIN = str(ROOT / "slurm" / "train.sbatch")
COMPARE = str(ROOT / "slurm" / "compare.sbatch")
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]  # this cluster's nodes: 2 CPUs, no GPUs
# Long enough (a few seconds of steps) for a signal sent after the first logged steps to land mid-run.
STEPS = 100
# 2 ranks on one node and 1 rank on each of two nodes reduce the same two numbers; allow for rounding.
LOSS_RTOL = 2e-5
JOB_TIMEOUT = 240
# The jobs' JIT-built DeepSpeed ops (the CPU shm all-reduce) go into a cache of their own: the shared
# ~/.cache/torch_extensions is rebuilt whenever processes with another `ninja` on PATH (the venv's or the
# system's) take turns with it, and a build killed midway leaves a lock that hangs every later job.
EXTENSIONS = Path.home() / ".cache" / "dstrain-slurm-tests" / "torch_extensions"


@pytest.fixture(scope="module")
def work(slurm_cluster, tmp_path_factory, corpus):
    """The submission folder, with runs/ (Slurm cannot create the log's folder) and the small recipe."""
    folder = tmp_path_factory.mktemp("slurm")
    build_ops()
    (folder / "runs").mkdir()
    small_recipe(folder, corpus, name="small", train={"steps": STEPS, "log_interval": 1, "eval_samples": 32})
    return folder


def build_ops() -> None:
    """Build (or find built) the DeepSpeed ops the jobs JIT-load, here rather than inside the first job's time
    limit: minutes on a busy 2-core machine the first time, a few seconds after."""
    for stale in EXTENSIONS.glob("*/lock"):  # left by a job killed while it built an op (no job runs yet)
        stale.unlink()
    python = Path(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",  # the venv's ninja, as in the jobs
        "TORCH_EXTENSIONS_DIR": str(EXTENSIONS),
        "OMP_NUM_THREADS": "1",
    }
    subprocess.run(
        [str(python), "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        env=env,
        check=True,
        capture_output=True,
        timeout=1800,
    )


def zero(stage: int) -> str:
    return str(ROOT / "ds_configs" / f"zero{stage}.json")


def submit(cluster, work, args: list[str], env: dict | None = None, wait: bool = True) -> int:
    """sbatch from ``work``; with ``wait``, until the job has ended, and fail with its log unless it ended well."""
    command = ["sbatch", "--parsable", *(["--wait"] if wait else []), *CPU_JOB, *args]
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS), **(env or {})}
    process = subprocess.Popen(command, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        err += f"(no end after {JOB_TIMEOUT} s)"
    found = re.match(r"\d+", out.strip())
    if process.returncode != 0 or not found:
        logs = "\n".join(
            p.read_text() for p in sorted((work / "runs").glob("slurm-*")) if found and found.group() in p.name
        )
        raise AssertionError(
            f"{' '.join(command)} exited {process.returncode}: {out}{err}\n{logs}\n{cluster.logs_tail()}"
        )
    return int(found.group())


def log_of(work, job: int) -> str:
    return (work / "runs" / f"slurm-{job}.out").read_text()


def run_of(work, job: int):
    return work / "runs" / f"small-{job}"


def assert_completed(run, steps: int, log: str) -> list[dict]:
    summary_file = run / "summary.json"
    assert summary_file.exists(), f"no summary.json in {run}; the job's log:\n{log}"
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "completed" and summary["step"] == steps, log
    records = [r for r in read_metrics(run) if "split" not in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "each step logged exactly once"
    assert (run / "checkpoints" / "latest").read_text() == f"global_step{steps}"
    return records


@pytest.fixture(scope="module")
def one_node_two_tasks(slurm_cluster, work):
    """The reference run: 1 node x 2 tasks under srun, ZeRO-0."""
    job = submit(slurm_cluster, work, ["--nodes=1", "--ntasks-per-node=2", TRAIN, "small.yaml", zero(0)])
    return job, run_of(work, job)


def test_one_node_two_tasks_trains_into_runs(work, one_node_two_tasks):
    job, run = one_node_two_tasks
    log = log_of(work, job)
    assert_completed(run, STEPS, log)
    assert f"job {job} attempt 1: 1 node(s) x 2 rank(s), launcher srun" in log
    losses = train_losses(run)
    assert losses[-1] < losses[0] - 0.5  # it learned
    # The run folder holds what the run resolved (2 ranks of 4 samples make the global batch of 8) and its log.
    assert json.loads((run / "ds_config.json").read_text())["train_batch_size"] == 8
    assert yaml.safe_load((run / "recipe.yaml").read_text())["run_dir"] == f"runs/small-{job}"
    link = run / f"slurm-{job}.out"
    assert link.is_symlink() and link.resolve() == (work / "runs" / f"slurm-{job}.out").resolve()


def test_two_nodes_one_task_each(slurm_cluster, work, one_node_two_tasks):
    """Ranks on the emulated nodes dsnode1 and dsnode2 form one 2-rank world: the same losses as on one node."""
    job = submit(slurm_cluster, work, ["--nodes=2", "--ntasks-per-node=1", TRAIN, "small.yaml", zero(0)])
    log = log_of(work, job)
    assert_completed(run_of(work, job), STEPS, log)
    assert "2 node(s) x 1 rank(s), launcher srun, master dsnode1:" in log
    np.testing.assert_allclose(train_losses(run_of(work, job)), train_losses(one_node_two_tasks[1]), rtol=LOSS_RTOL)


def wait_for_steps(cluster, work, job: int, steps: int, timeout: float = JOB_TIMEOUT) -> None:
    metrics = run_of(work, job) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and sum('"split"' not in line for line in metrics.read_text().splitlines()) >= steps:
            return
        if cluster.job_state(job) in (None, "FAILED", "CANCELLED", "COMPLETED"):
            break
        time.sleep(0.2)
    log_file = work / "runs" / f"slurm-{job}.out"
    raise AssertionError(
        f"job {job} logged no {steps} steps (state {cluster.job_state(job)}):\n"
        f"{log_file.read_text() if log_file.exists() else '(no log)'}\n{cluster.logs_tail()}"
    )


@pytest.mark.parametrize(
    "launcher, nodes, scancel",
    [
        # USR1 to the batch shell, as `#SBATCH --signal=B:USR1@600` sends it before the time limit: it forwards it.
        pytest.param("srun", 1, ["--batch", "--signal=USR1"], id="USR1-to-batch-shell"),
        # USR1 straight to every process of the training step (`--signal=USR1@600` without B:, or an admin's
        # scancel): the deepspeed launchers on both nodes must survive it, the trainer ranks stop.
        pytest.param("deepspeed", 2, ["--signal=USR1"], id="USR1-to-all-deepspeed-2-nodes"),
        # SIGTERM straight to the trainer ranks (`scancel --signal=TERM`): the same checkpoint and requeue.
        pytest.param("srun", 1, ["--signal=TERM"], id="TERM-to-steps"),
    ],
)
def test_signal_checkpoints_requeues_and_resumes(slurm_cluster, work, one_node_two_tasks, launcher, nodes, scancel):
    """Signal mid-run -> the trainer checkpoints and stops ("interrupted") -> the job requeues itself -> same job id,
    same run folder -> resumes from the checkpoint -> the losses of an uninterrupted run, step for step."""
    per_node = 2 // nodes
    job = submit(
        slurm_cluster,
        work,
        [f"--nodes={nodes}", f"--ntasks-per-node={per_node}", TRAIN, "small.yaml", zero(0)],
        env={"LAUNCHER": launcher},
        wait=False,
    )
    wait_for_steps(slurm_cluster, work, job, 3)
    slurm_cluster.run(["scancel", *scancel, str(job)])
    restarts = restarts_until_gone(slurm_cluster, job)

    # The contract, not the wording of any log: Slurm requeued the job once, the stop published a checkpoint
    # of a step before the end, the same job id finished the same run folder, and the losses are the
    # uninterrupted run's, each step logged once.
    log = log_of(work, job)
    run = run_of(work, job)
    assert restarts == 1, f"requeued {restarts} times\n{log}"
    stops = [int(p.name.removeprefix("global_step")) for p in (run / "checkpoints").glob("global_step*")]
    assert len(stops) == 2 and 3 <= min(stops) < STEPS, f"checkpoints {sorted(stops)}; raise STEPS?\n{log}"
    if launcher == "deepspeed":
        assert (run / "hostfile").read_text() == "dsnode1 slots=1\ndsnode2 slots=1\n"
    assert_completed(run, STEPS, log)
    reference = train_losses(one_node_two_tasks[1])
    if nodes == 1:
        assert train_losses(run) == reference  # bit for bit: same data, same state, same order
    else:
        np.testing.assert_allclose(train_losses(run), reference, rtol=LOSS_RTOL)


def restarts_until_gone(cluster, job: int, timeout: float = JOB_TIMEOUT) -> int:
    """The job's requeue count, watched until it has ended (the controller forgets it MinJobAge after that)."""
    deadline, restarts = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        shown = cluster.run(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
        restarts = max([restarts, *map(int, re.findall(r"\bRestarts=(\d+)", shown))])
        if re.search(r"\bJobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)\b", shown) or not shown.strip():
            cluster.wait_gone([job], JOB_TIMEOUT)
            return restarts
        time.sleep(0.5)
    raise AssertionError(f"job {job} still there after {timeout} s\n{cluster.logs_tail()}")


def test_compare_array_one_result_per_config(slurm_cluster, work):
    """`sbatch --array=0-2 compare.sbatch RECIPE OUT C0 C1 C2`: task i trains under config i into OUT/<stem>/."""
    stages = [0, 2, 3]
    submit(
        slurm_cluster,
        work,
        [
            "--array=0-2",
            "--nodes=1",
            "--ntasks-per-node=2",
            COMPARE,
            "small.yaml",
            "cmp",
            *[zero(s) for s in stages],
            "train.steps=6",
        ],
    )
    out = work / "cmp"
    logs = "\n".join(p.read_text() for p in sorted((work / "runs").glob("slurm-compare-*.out")))
    assert sorted(p.name for p in out.iterdir()) == [f"zero{s}" for s in stages], logs
    losses = {}
    for stage in stages:
        run = out / f"zero{stage}"
        assert_completed(run, 6, logs)
        assert json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
        assert len(list(run.glob("slurm-*.out"))) == 1  # the array task's log, linked in
        losses[stage] = train_losses(run)
    for stage in stages[1:]:  # same recipe, same samples: the strategies agree (fp32)
        np.testing.assert_allclose(losses[stage], losses[0], rtol=LOSS_RTOL)


def test_a_bad_override_fails_the_job_at_once_with_the_reason(slurm_cluster, work):
    """The recipe is checked in the batch shell, before any rank starts: one line in the log, no run folder."""
    with pytest.raises(AssertionError, match=r"exited 1: (\d+)") as failed:
        submit(slurm_cluster, work, ["--nodes=1", "--ntasks-per-node=2", TRAIN, "small.yaml", zero(0), "train.stepz=5"])
    job = int(re.search(r"exited 1: (\d+)", str(failed.value)).group(1))
    log = log_of(work, job)
    assert re.search(r"train\.sbatch: error: .*train\.stepz", log), log
    assert not run_of(work, job).exists()
    # The script's own options too (dstrain.train.elastic): more spares than nodes, before any rank starts.
    with pytest.raises(AssertionError, match=r"exited 2: (\d+)") as failed:
        submit(
            slurm_cluster, work, ["--nodes=2", "--ntasks-per-node=1", TRAIN, "--spare-nodes=2", "small.yaml", zero(0)]
        )
    job = int(re.search(r"exited 2: (\d+)", str(failed.value)).group(1))
    log = log_of(work, job)
    assert "train.sbatch: --spare-nodes=2 with 2 node(s) allocated leaves no node to train on" in log, log
    assert "attempt 1" not in log and not (run_of(work, job) / "metrics.jsonl").exists()


PREPARE = str(ROOT / "slurm" / "prepare.sbatch")


def test_prepare_array_on_two_nodes_then_dependent_merge(slurm_cluster, work, corpus):
    """`sbatch --array=0-1 prepare.sbatch ...` (each task a whole node: one on dsnode1, one on dsnode2), then the
    `--merge` job with --dependency=afterok: the merged folder holds one process's documents, order and tokens."""
    from dstrain.data.manifest import read_manifest
    from dstrain.data.prepare import prepare

    from data_fixtures import read_texts

    parts = work / "parts"
    parts.mkdir()
    texts = read_texts(read_manifest(corpus).source.dataset)
    for i in range(5):  # 5 files for 2 tasks: split by files
        lines = [json.dumps({"text": t}) + "\n" for t in texts[i * 60 : (i + 1) * 60]]
        (parts / f"part_{i}.jsonl").write_text("".join(lines), encoding="utf-8")
    source, tokenizer = str(parts / "part_*.jsonl"), str(corpus / "tokenizer")
    options = ["--dataset", source, "--tokenizer", tokenizer, "--shard-tokens", "20000", "--num-proc", "1"]
    array = submit(
        slurm_cluster,
        work,
        ["--array=0-1", "--cpus-per-task=2", PREPARE, *options, "--out", "prepared"],
        wait=False,
    )
    merge = submit(slurm_cluster, work, [f"--dependency=afterok:{array}", PREPARE, "--merge", "prepared"])
    logs = {i: (work / "runs" / f"slurm-prepare-{array}_{i}.out").read_text() for i in range(2)}
    assert "array task 0 of 2" in logs[0] and "array task 1 of 2" in logs[1], logs
    nodes = {re.search(r"\) on (\S+),", log).group(1) for log in logs.values()}
    assert nodes == {"dsnode1", "dsnode2"}, logs
    (merge_log,) = (work / "runs").glob(f"slurm-prepare-{merge}_*.out")  # not an array: Slurm fills in a NO_VAL
    assert "merged" in merge_log.read_text()

    single = prepare(source, work / "single", tokenizer=tokenizer, shard_tokens=20000, num_proc=1, progress=False)
    merged = read_manifest(work / "prepared")
    ignored = {"shards": [], "command": ""}
    assert dataclasses.replace(merged, **ignored) == dataclasses.replace(single, **ignored)
    for name in ("tokens", "sizes"):
        ours, theirs = (
            np.concatenate([getattr(ShardReader.open(folder / s.prefix), name) for s in m.shards])
            for folder, m in ((work / "prepared", merged), (work / "single", single))
        )
        assert np.array_equal(ours, theirs)
    assert not (work / "prepared" / "tasks").exists()


# --- a node that dies: the job keeps its allocation and relaunches (slurm/train.sbatch, dstrain.train.elastic) -------
# Last in this file: these tests kill a node's slurmd (started again before they end).
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
