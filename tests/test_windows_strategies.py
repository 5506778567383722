"""Local attention, layers without RoPE and Gemma's conventions under every strategy (CPU ranks, gloo, fp32): a
small model with a window shorter than the sequence, packed documents, a block without RoPE, sandwich norms, (1+w)
RMSNorm, GeGLU, query_pre_attn_scalar, a local RoPE base, partial rotary and soft caps gives ZeRO-0's losses AND
pre-clip gradient norms under ZeRO-3, TP2, PP2 and SP2 (Ulysses: the window applies to the global positions of the
gathered sequence, and crosses the two ranks' halves). GPT-OSS's features (sinks, biases, its experts) under EP2
give EP1's; Llama 4's chunks, temperature tuning and q/k norm under TP2 and SP2 give ZeRO-0's. One process group for
all ten runs of 5 steps."""

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
    "attn_softcap": 2.0,  # Gemma 2's soft caps, low enough to act: on the pipeline's last stage too (HeadPipe)
    "logit_softcap": 1.5,
}
# GPT-OSS's features at a small size: sinks, alternating windows, biases on q/k/v/o, a biased router, biased experts
# with the clamped SwiGLU (a limit low enough to clamp these small activations).
GPT_OSS = {
    "doc_masking": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "attention_sinks": True,
    "qkv_bias": True,
    "o_bias": True,
    "moe": {"num_experts": 4, "top_k": 2, "router_bias": True, "expert_bias": True, "swiglu_limit": 0.5},
}
# Llama 4's attention (issue 50): 8-token chunks (crossing SP2's halves at 16), a block without RoPE whose q is
# temperature-tuned from position 3 on (counted over the gathered sequence under SP), the weightless q/k norm.
CHUNKED = {
    "doc_masking": True,
    "layer_types": ["chunked_attention", "full_attention"],
    "attention_chunk": 8,
    "nope_layers": [1],
    "qk_norm": "l2",
    "attn_temperature_floor": 4,
    "attn_temperature_scale": 0.5,
}
MOE_RTOL = 1e-5  # as tests/test_moe.py: DeepSpeed's MoE dispatch sums the experts' outputs in another order
LAYOUTS = ["zero3", "tp2_zero1", "pp2_zero1", "sp2_zero1"]
RUNS = [
    ("windowed", "zero0"),
    *(("windowed", name) for name in LAYOUTS),
    ("gpt_oss", "zero1"),
    ("gpt_oss", "ep2_zero1"),
    *(("chunked", name) for name in ("zero0", "tp2_zero1", "sp2_zero1")),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("windows")
    recipes = {
        name: small_recipe(tmp, corpus, name=name, model=model)
        for name, model in [("windowed", WINDOWED), ("gpt_oss", GPT_OSS), ("chunked", CHUNKED)]
    }
    argvs = [train_argv(recipes[model], ds, tmp / f"{model}_{ds}", "train.steps=5") for model, ds in RUNS]
    assert run_ranks(2, train_each, argvs) == [[0] * len(argvs)] * 2
    return {(m, ds): [r for r in read_metrics(tmp / f"{m}_{ds}") if "split" not in r] for m, ds in RUNS}


def assert_same_steps(got: list[dict], want: list[dict], rtol: float) -> None:
    assert len(got) == len(want) == 5
    for key in ("loss", "grad_norm"):
        for g, w in zip([r[key] for r in got], [r[key] for r in want], strict=True):
            assert abs(g - w) <= rtol * abs(w), (key, g, w)
    assert want[-1]["loss"] < want[0]["loss"]  # it learns


@pytest.mark.parametrize("layout", LAYOUTS)
def test_windowed_model_gives_zero0_losses_and_grad_norms(runs, layout):
    assert_same_steps(runs["windowed", layout], runs["windowed", "zero0"], RTOL)


def test_gpt_oss_features_under_expert_parallelism_give_ep1_losses_and_grad_norms(runs):
    assert_same_steps(runs["gpt_oss", "ep2_zero1"], runs["gpt_oss", "zero1"], MOE_RTOL)


@pytest.mark.parametrize("layout", ["tp2_zero1", "sp2_zero1"])
def test_llama4_attention_gives_zero0_losses_and_grad_norms(runs, layout):
    assert_same_steps(runs["chunked", layout], runs["chunked", "zero0"], RTOL)
