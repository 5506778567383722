"""Process-group set-up for every way a run can be launched.

The `deepspeed` launcher, torchrun and `accelerate launch` export RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `srun` exports SLURM_* instead; a plain
`python -m dstrain.train` exports nothing and runs as a world of one.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import socket
import subprocess
from datetime import timedelta

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from dstrain.errors import DstrainError
from dstrain.train.process import console
from dstrain.train.process.launcher_env import launched_by_srun


def _slurm_env() -> dict[str, str]:
    """RANK and friends from an `srun` task (one task per device)."""
    env = {
        "RANK": os.environ["SLURM_PROCID"],
        "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        "LOCAL_RANK": os.environ["SLURM_LOCALID"],
    }
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        )
        env["MASTER_ADDR"] = hosts.stdout.split()[0]
    if "MASTER_PORT" not in os.environ:
        env["MASTER_PORT"] = str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
    return env


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous of a single-node run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_deepspeed_shm_allreduce() -> None:
    """Keep DeepSpeed from building and mapping its CPU shared-memory all-reduce (DeepSpeed 0.19.x).

    Its only user is ``inference_all_reduce``, which training never calls and which falls back to the
    process group without it. With it, every CPU run leaves a ~69 MB /dev/shm/deepspeed_allreduce_buffer_*
    per rank behind (csrc/cpu/comm/shm.cpp never unlinks it; sglang PR #38638 saw the same fill /dev/shm),
    and once /dev/shm is full every later start segfaults in ``shm_initialize``, whose failed ``write()``
    leaves an unchecked mmap result that it then writes to. A CI machine died this way.
    tests/test_distributed.py::test_deepspeed_shm_allreduce_still_leaks notices a fix upstream.
    """
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")  # None off CPU
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # what deepspeed.comm.torch.build_shm_op checks


def init() -> None:
    """Join (or create) the process group and give each local rank its share of the CPU threads."""
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:
        if launched_by_srun():
            os.environ.update(_slurm_env())
        else:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
    # torchrun/accelerate export LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE, srun e.g. "2(x2)".
    per_node = (
        os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ.get("SLURM_TASKS_PER_NODE")
    )
    local_world = int(re.findall(r"\d+", per_node or os.environ["WORLD_SIZE"])[0])
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one node must not oversubscribe its cores (on GPUs this only affects host-side work).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    # Our own progress line says what matters; a training run keeps DeepSpeed's INFO lines in its logs (console.py).
    deepspeed.utils.logger.setLevel(logging.INFO if console.active() else logging.WARNING)
    skip_deepspeed_shm_allreduce()
    # A rank that dies closes its connections and the others fail at once; this bounds a rank that hangs.
    timeout = timedelta(seconds=int(os.environ.get("DSTRAIN_COLLECTIVE_TIMEOUT_S", "1800")))
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(), auto_mpi_discovery=False, timeout=timeout
    )
    atexit.register(shutdown)


def shutdown() -> None:
    """Tear the process group down before the interpreter exits, on every path out of every command that
    started one (success, refusal, error, a second signal's SystemExit). Left to interpreter exit, gloo's
    threads race with it: "terminate called without an active exception" and exit -6 after the work is done,
    in place of the real exit status that Slurm's requeue logic, CI and scripts read."""
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups
    # The engine and its optimizer hold the groups too, in reference cycles that only the collector frees: free them
    # now, while the interpreter is whole, so gloo joins its threads here and not at finalization (one such abort,
    # after "completed", was seen in a CI run's Slurm job; pytorch/pytorch#179291 describes the race).
    gc.collect()


def all_ok(ok: bool) -> bool:
    """True on every rank only if ``ok`` is true on every rank, so all ranks stop together."""
    flag = torch.tensor([1.0 if ok else 0.0], device=get_accelerator().current_device_name())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def on_rank0(action, what: str):
    """``action()`` on global rank 0 while the others wait; a refusal there (DstrainError) is raised on every rank,
    so all stop together with rank 0's line. Returns what rank 0's action returned (None elsewhere)."""
    result, error = None, None
    if rank() == 0:
        try:
            result = action()
        except DstrainError as e:
            error = e
    if not all_ok(error is None):
        raise error or DstrainError(f"rank 0 could not {what}; see its message")
    return result


def rank() -> int:
    return torch.distributed.get_rank()


def world_size() -> int:
    return torch.distributed.get_world_size()
