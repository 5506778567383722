"""What the Slurm tests submit (tests/test_slurm.py, tests/test_slurm_node_loss.py): the submission folder with its
small recipe and the reference run (session fixtures, imported by conftest.py so both modules share them), sbatch,
and a job's run folder read back.

The cluster has two emulated nodes of 2 CPUs on this machine and no GPUs, so every job asks for
--gpus-per-node=0 --cpus-per-task=1 over the scripts' GPU defaults, as sbatch options do on a real
cluster. Jobs are submitted from a temp folder (their runs/ lands there) with the scripts' absolute
paths, as a user submitting from elsewhere would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import ROOT, read_metrics, small_recipe

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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def one_node_two_tasks(slurm_cluster, work):
    """The reference run: 1 node x 2 tasks under srun, ZeRO-0."""
    job = submit(slurm_cluster, work, ["--nodes=1", "--ntasks-per-node=2", TRAIN, "small.yaml", zero(0)])
    return job, run_of(work, job)


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
