"""Which sample indices each data-parallel rank reads, micro-batch by micro-batch.

Global batch ``b`` is samples ``[b*G, (b+1)*G)`` whatever the parallel layout; rank
``r`` of ``dp`` takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` and splits it into
micro-batches in order. So the k-th global batch holds the same samples for any
data-parallel size, micro-batch size or gradient accumulation, and a run resumed at
``consumed_samples`` continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

from dstrain.errors import DstrainError


def valid_micro_batches(global_batch: int, dp_size: int) -> list[int]:
    """Micro-batch sizes that split ``global_batch`` evenly over ``dp_size`` data-parallel ranks."""
    per_rank = global_batch // dp_size if global_batch % dp_size == 0 else 0
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def micro_batches(
    consumed_samples: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> Iterator[list[int]]:
    """Endless micro-batches (lists of sample indices) of rank ``dp_rank``, from ``consumed_samples``."""
    if global_batch < 1 or micro_batch < 1 or dp_size < 1:
        raise DstrainError(
            f"global batch {global_batch}, micro-batch {micro_batch}, data-parallel size {dp_size}: all must be >= 1"
        )
    if not 0 <= dp_rank < dp_size:
        raise DstrainError(f"data-parallel rank {dp_rank} is outside [0, {dp_size})")
    if global_batch % dp_size:
        raise DstrainError(
            f"global batch {global_batch} does not split over {dp_size} data-parallel ranks; "
            f"use a global batch that is a multiple of {dp_size}"
        )
    per_rank = global_batch // dp_size
    if per_rank % micro_batch:
        valid = valid_micro_batches(global_batch, dp_size)
        raise DstrainError(
            f"micro-batch {micro_batch} does not divide the {per_rank} samples per rank of global batch "
            f"{global_batch} over {dp_size} ranks; valid micro-batch sizes: {', '.join(map(str, valid))}"
        )
    if consumed_samples < 0 or consumed_samples % global_batch:
        raise DstrainError(
            f"consumed_samples {consumed_samples} is not a whole number of global batches of {global_batch}; "
            f"resume from a checkpoint saved at a step boundary, or keep the global batch it was saved with"
        )
    return _rank_micro_batches(consumed_samples // global_batch, global_batch, per_rank, micro_batch, dp_rank)


def _rank_micro_batches(
    batch: int, global_batch: int, per_rank: int, micro_batch: int, dp_rank: int
) -> Iterator[list[int]]:
    while True:
        first = batch * global_batch + dp_rank * per_rank
        for start in range(first, first + per_rank, micro_batch):
            yield list(range(start, start + micro_batch))
        batch += 1
