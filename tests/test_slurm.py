"""slurm/train.sbatch and slurm/compare.sbatch, submitted to a real Slurm cluster (tests/slurm_cluster.py).

What the jobs are and how they are submitted: tests/slurm_jobs.py; a node that dies: tests/test_slurm_node_loss.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

import numpy as np
import pytest
import yaml

from dstrain.data.shards import ShardReader

from slurm_jobs import (
    COMPARE,
    JOB_TIMEOUT,
    LOSS_RTOL,
    STEPS,
    TRAIN,
    assert_completed,
    log_of,
    restarts_until_gone,
    run_of,
    submit,
    zero,
)
from train_helpers import ROOT, train_losses

pytestmark = pytest.mark.slurm


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
    # The script's own options too (dstrain.train.process.elastic): more spares than nodes, before any rank starts.
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
