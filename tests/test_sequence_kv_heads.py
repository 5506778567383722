"""Ulysses sequence parallelism beyond the key/value heads (dstrain.train.engine.sequence: each rank repeats its
key/value
heads before the all-to-all): a tiny model with 1 and 2 key/value heads (4 query heads) under SP 2 and SP 4 gives
ZeRO-0's losses AND pre-clip gradient norms on CPU ranks (gloo, fp32), with document masking, a sliding window and
the chunked loss. The same suite shape as tests/test_sequence.py, at its smallest: 2 ranks, then 4."""

from __future__ import annotations

import pytest

import train_helpers
from ranks import run_ranks
from train_helpers import ds_config, read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

# The bound. Measured: within 1.6e-7 (relative) of ZeRO-0 over 10 steps (the repeat's backward sums the
# replicas' gradients in another order than the core's own GQA repeat). A query head reading another group's
# key/value head would change the first loss itself, a replica's gradient lost the first gradient norm.
RTOL = 1e-5


def run_all(calls: list) -> list:
    """Rank target: call each (train_helpers function, args) in turn, in one process group."""
    return [getattr(train_helpers, name)(*args) for name, args in calls]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus):
    tmp = tmp_path_factory.mktemp("sequence_kv")
    # 1 key/value head, documents masked; 2 key/value heads, every block local (a 16-token window)
    kv1 = small_recipe(tmp, tiny_corpus, name="kv1", model={"n_kv_head": 1, "doc_masking": True})
    kv2 = small_recipe(tmp, tiny_corpus, name="kv2", model={"n_kv_head": 2, "sliding_window": 16})
    sp4_zero1 = ds_config(tmp, "sp2_zero1", sequence_parallel_size=4, tiling={"loss": 2})  # 8 tokens a rank, 2 chunks
    sp4_zero3 = ds_config(tmp, "sp2_zero3", sequence_parallel_size=4)
    two = [
        ("train", [train_argv(kv1, "zero0", tmp / "kv1_zero0")]),
        ("train", [train_argv(kv2, "zero0", tmp / "kv2_zero0")]),
        ("train", [train_argv(kv1, "sp2_zero3", tmp / "kv1_sp2_zero3")]),  # 2 replicas of the one head
    ]
    assert run_ranks(2, run_all, two) == [[0] * len(two)] * 2
    four = [
        ("train", [train_argv(kv1, sp4_zero1, tmp / "kv1_sp4_zero1")]),  # 4 replicas, chunked loss
        ("train", [train_argv(kv2, sp4_zero3, tmp / "kv2_sp4_zero3")]),  # 2 replicas of each head
    ]
    assert run_ranks(4, run_all, four) == [[0] * len(four)] * 4
    return {p.name: [r for r in read_metrics(p) if "split" not in r] for p in tmp.iterdir() if p.is_dir()}


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) == 10 and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize(
    "run, reference",
    [
        ("kv1_sp2_zero3", "kv1_zero0"),
        ("kv1_sp4_zero1", "kv1_zero0"),
        ("kv2_sp4_zero3", "kv2_zero0"),
    ],
)
def test_sequence_parallel_beyond_the_kv_heads_gives_zero0_losses_and_grad_norms(runs, run, reference):
    got, want = runs[run], runs[reference]
    assert close([r["loss"] for r in got], [r["loss"] for r in want])
    assert close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want])


def test_kv_replicas():
    """The fewest copies that give each rank whole groups: Llama-3-8B's 32 query and 8 key/value heads."""
    from dstrain.strategy.parallel import kv_replicas

    assert [kv_replicas(32, 8, sp) for sp in (1, 2, 4, 8, 16, 32)] == [1, 1, 1, 1, 2, 4]
    assert [kv_replicas(4, 1, sp) for sp in (2, 4)] == [2, 4]
    assert kv_replicas(12, 4, 6) == 3  # 4·3 = 12 heads, 2 per rank: each its own group's
