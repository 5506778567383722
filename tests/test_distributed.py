"""Process-group set-up: DeepSpeed's CPU shared-memory all-reduce stays out of our runs."""

import os
from pathlib import Path

import pytest

from ranks import run_ranks

SHM = Path("/dev/shm")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm on Linux only"),
]


def shm_buffers(port: str) -> list[Path]:
    """The files DeepSpeed's shm_initialize names /deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>."""
    return sorted(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))


def deepspeed_init_then_all_reduce(ours: bool) -> tuple[str, float]:
    import deepspeed
    import torch

    from dstrain.train.process import distributed

    if ours:
        distributed.init()
    else:
        deepspeed.init_distributed(dist_backend="gloo")
    total = torch.tensor([float(torch.distributed.get_rank() + 1)])
    torch.distributed.all_reduce(total)
    return os.environ["MASTER_PORT"], total.item()


@pytest.mark.deepspeed_defect(
    "DeepSpeed's CPU shm all-reduce never unlinks its /dev/shm buffer "
    "(train/process/distributed.py::skip_deepspeed_shm_allreduce)"
)
def test_deepspeed_shm_allreduce_still_leaks():
    """DeepSpeed 0.19.x leaves one ~69 MB buffer per rank in /dev/shm after every CPU run.

    When this fails, DeepSpeed cleans up after itself: distributed.skip_deepspeed_shm_allreduce may go.
    """
    (port, total), _ = run_ranks(2, deepspeed_init_then_all_reduce, False)
    left = shm_buffers(port)
    for path in left:
        path.unlink()
    assert total == 3.0
    assert [p.name[-2:] for p in left] == ["_0", "_1"], "DeepSpeed no longer leaves its shm all-reduce buffers behind"


def test_our_runs_leave_nothing_in_dev_shm():
    (port, total), _ = run_ranks(2, deepspeed_init_then_all_reduce, True)
    assert total == 3.0
    assert shm_buffers(port) == []
