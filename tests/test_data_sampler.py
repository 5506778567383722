"""Micro-batch sampling: the k-th global batch is the same whatever the parallel layout or resume point."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest

from dstrain.data.dataset import build_dataset, collate
from dstrain.data.sampler import micro_batches
from dstrain.errors import DstrainError

GLOBAL_BATCH = 24
LAYOUTS = [(1, 1), (1, 24), (2, 4), (2, 12), (3, 2), (4, 3), (4, 6), (6, 4), (8, 1)]  # (dp size, micro-batch)


def global_batches(consumed: int, dp_size: int, micro: int, count: int) -> list[list[list[int]]]:
    """For each of ``count`` global batches: every rank's micro-batches, in rank order."""
    steps = GLOBAL_BATCH // dp_size // micro  # gradient-accumulation steps per global batch
    ranks = [micro_batches(consumed, GLOBAL_BATCH, micro, r, dp_size) for r in range(dp_size)]
    return [[list(islice(rank, steps)) for rank in ranks] for _ in range(count)]


@pytest.mark.parametrize("dp_size, micro", LAYOUTS)
def test_global_batches_do_not_depend_on_the_layout(dp_size, micro):
    for b, per_rank in enumerate(global_batches(0, dp_size, micro, 5)):
        flat = [i for rank in per_rank for batch in rank for i in batch]
        assert flat == list(range(b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH))
        assert all(len(batch) == micro for rank in per_rank for batch in rank)
        rank_sets = [{i for batch in rank for i in batch} for rank in per_rank]
        assert sum(map(len, rank_sets)) == len(set().union(*rank_sets)) == GLOBAL_BATCH  # disjoint ranks


@pytest.mark.parametrize("dp_size, micro", [(1, 6), (2, 3), (4, 2)])
def test_resume_continues_exactly_where_the_run_stopped(dp_size, micro):
    fresh = global_batches(0, dp_size, micro, 7)
    resumed = global_batches(3 * GLOBAL_BATCH, dp_size, micro, 4)
    assert resumed == fresh[3:]


def test_same_global_batch_tokens_on_one_or_four_ranks(tiny_corpus, tmp_path):
    ds = build_dataset(
        [(str(tiny_corpus), 1.0)],
        "train",
        32,
        seed=2,
        num_samples=GLOBAL_BATCH * 6,
        valid_fraction=0.1,
        cache_dir=tmp_path,
    )

    def tokens_of_batch(b: int, dp_size: int, micro: int) -> np.ndarray:
        per_rank = global_batches(0, dp_size, micro, b + 1)[b]
        batches = [collate([ds[i] for i in batch])["input_ids"].numpy() for rank in per_rank for batch in rank]
        return np.concatenate(batches)

    np.testing.assert_array_equal(tokens_of_batch(4, 1, 8), tokens_of_batch(4, 4, 2))


@pytest.mark.parametrize(
    "consumed, micro, dp_size, expected",
    [
        (10, 2, 2, "consumed_samples 10 is not a whole number of global batches of 24"),
        (0, 5, 2, "valid micro-batch sizes: 1, 2, 3, 4, 6, 12"),
        (0, 1, 5, "does not split over 5 data-parallel ranks"),
    ],
)
def test_inconsistent_batch_settings_are_one_line_errors(consumed, micro, dp_size, expected):
    with pytest.raises(DstrainError) as error:
        micro_batches(consumed, GLOBAL_BATCH, micro, 0, dp_size)  # raises before any batch is drawn
    assert expected in str(error.value) and "\n" not in str(error.value)
