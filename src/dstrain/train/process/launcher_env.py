"""Which rank this process is, and of how many, as its launcher says, before any process group exists.

The `deepspeed` launcher, torchrun and `accelerate launch` export RANK / WORLD_SIZE / LOCAL_RANK; `srun` exports
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID instead (``distributed.init`` maps them onto the former); a plain
`python -m dstrain.train` exports nothing and is rank 0 of 1. Torch-free: read before anything prints, so that a
refusal before the process group starts is printed by one task, not by every task of an `srun`.
"""

from __future__ import annotations

import os


def launched_by_srun() -> bool:
    """One of several `srun` tasks that no other launcher gave a RANK."""
    return "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def env_rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ["SLURM_PROCID"]) if launched_by_srun() else 0


def env_world_size() -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_NTASKS"]) if launched_by_srun() else 1
