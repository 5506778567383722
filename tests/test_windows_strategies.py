"""Local attention, layers without RoPE and Gemma 3's conventions under every strategy (CPU ranks, gloo, fp32): a
small model with a window shorter than the sequence, packed documents, a block without RoPE, sandwich norms, (1+w)
RMSNorm, GeGLU, query_pre_attn_scalar, a local RoPE base and partial rotary gives ZeRO-0's losses AND pre-clip
gradient norms under ZeRO-3, TP2, PP2 and SP2 (Ulysses: the window applies to the global positions of the gathered
sequence, and crosses the two ranks' halves). One process group for all five runs (~30 s on 2 idle cores)."""

from __future__ import annotations

import pytest

from ranks import run_ranks
from train_helpers import read_metrics, small_recipe, train_argv, train_each

pytestmark = pytest.mark.distributed

RTOL = 1e-6  # as tests/test_sequence.py and tests/test_parallel.py: the same fp32 sums in another order
WINDOWED = {
    "doc_masking": True,
    "sliding_window": 8,  # data.seq_len is 32: the window cuts, and crosses SP2's halves of 16
    "layer_types": ["sliding_attention", "full_attention"],
    "nope_layers": [1],
    "norm_placement": "sandwich",
    "norm_unit_offset": True,
    "qk_norm": "head",
    "mlp_activation": "gelu_tanh",
    "scale_embeddings": True,
    "query_pre_attn_scalar": 24.0,
    "rope_local_theta": 100.0,
    "partial_rotary_factor": 0.5,
}
LAYOUTS = ["zero3", "tp2_zero1", "pp2_zero1", "sp2_zero1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("windows")
    recipe = small_recipe(tmp, corpus, name="windowed", model=WINDOWED)
    argvs = [train_argv(recipe, name, tmp / name, "train.steps=5") for name in ["zero0", *LAYOUTS]]
    assert run_ranks(2, train_each, argvs) == [[0] * len(argvs)] * 2
    return {name: [r for r in read_metrics(tmp / name) if "split" not in r] for name in ["zero0", *LAYOUTS]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_windowed_model_gives_zero0_losses_and_grad_norms(runs, layout):
    want, got = runs["zero0"], runs[layout]
    assert len(got) == len(want) == 5
    for key in ("loss", "grad_norm"):
        for g, w in zip([r[key] for r in got], [r[key] for r in want], strict=True):
            assert abs(g - w) <= RTOL * abs(w), (layout, key, g, w)
    assert want[-1]["loss"] < want[0]["loss"]  # it learns
