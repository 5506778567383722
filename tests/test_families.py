"""Published families in and out: a small random transformers model of each family, built from its own config class
(never downloaded) -> from_hf -> our GPT gives its logits (fp32, 1e-5), also on packed documents; to_hf gives the same
class back with the same logits, and the exported folder loads in transformers with no missing or unexpected weight.
What the conversion computes and refuses (RoPE frequencies, published sizes, features not computed):
tests/test_family_configs.py."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.hf.convert import from_hf, to_hf  # noqa: E402

from family_fixtures import (  # noqa: E402
    ATOL,
    FAMILIES,
    LENGTH,
    VOCAB,
    build_hf,
    max_diff,
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request):
    """(the transformers model, from_hf's config and state dict) of one family, built once for its tests."""
    hf = build_hf(request.param)
    return (hf, *from_hf(hf))


@torch.no_grad()
def test_imported_family_gives_transformers_logits(imported):
    hf, config, state = imported
    config = dataclasses.replace(config)  # a copy: doc_masking is flipped below
    ours = GPT(config).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (2, LENGTH))  # longer than every window: the window cuts
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL
    if config.sliding_window is not None:
        unwindowed = GPT(dataclasses.replace(config, sliding_window=None, layer_types=None)).eval()
        unwindowed.load_state_dict(state, strict=True)
        assert max_diff(unwindowed(ids), hf(ids).logits) > 1e-3
    position_ids = torch.cat([torch.arange(19), torch.arange(LENGTH - 19)]).expand(2, -1)
    plain = hf(ids, position_ids=position_ids, attention_mask=torch.ones_like(ids)).logits
    assert max_diff(ours(ids, position_ids), plain) <= ATOL
    assert max_diff(plain, hf(ids).logits) > 1e-3  # the positions did matter
    # Packed documents: each document run alone through transformers (its own packed-document detection misses
    # GPT-OSS's eager attention in transformers 5.23: its second document then attends to the first).
    packed = torch.cat([hf(ids[:, :19]).logits, hf(ids[:, 19:]).logits], dim=1)
    config.doc_masking = True
    assert max_diff(ours(ids, position_ids), packed) <= ATOL


@torch.no_grad()
def test_exported_family_is_the_same_class_with_the_same_logits(imported, tmp_path):
    hf, config, state = imported
    hf_config, hf_state = to_hf(config, state)
    assert hf_config.architectures == [type(hf).__name__]
    hf_config._attn_implementation = hf.config._attn_implementation
    again = type(hf)(hf_config).eval()
    again.load_state_dict(hf_state, strict=True)
    ids = torch.randint(0, VOCAB, (2, 20))
    assert torch.equal(again(ids).logits, hf(ids).logits)
    again.save_pretrained(tmp_path)
    loaded, info = type(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(transformers.AutoModelForCausalLM.from_config(loaded.config)) is type(hf)
    assert max_diff(loaded.eval()(ids).logits, hf(ids).logits) <= ATOL
    assert from_hf(tmp_path)[0] == config  # config.json -> the same model.* fields


@pytest.mark.parametrize(
    "family",
    ["mistral", "smollm3", "phi3", "gemma2", "gemma3", "gpt_oss", "olmo3", "phi3-longrope", "llama4"]
    + ["deepseek_v3", "deepseek_v2", "glm4_moe", "llama4_moe"],
)
@torch.no_grad()
def test_greedy_generation_equals_transformers_generate(family):
    """Past the windows (6 + 14 tokens > 16): transformers decodes with its cache (a sliding one on local layers),
    we recompute the whole sequence each step; the tokens must agree (the other families: tests/test_hf.py's llama)."""
    hf = build_hf(family)
    config, state = from_hf(hf)
    ours = GPT(config).eval()
    ours.load_state_dict(state, strict=True)
    prompt = torch.randint(2, VOCAB, (2, 6))
    greedy = transformers.GenerationConfig(max_new_tokens=14, do_sample=False, pad_token_id=1, eos_token_id=None)
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    assert generated.shape == (2, 20)  # no early stop: every step compared
    tokens = prompt
    for _ in range(14):
        tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize(
    "family, feature, without",
    [
        ("smollm3", "nope_layers", []),
        ("phi3", "partial_rotary_factor", 1.0),
        ("gemma3", "rope_local_theta", None),
        ("gemma3", "query_pre_attn_scalar", None),
        ("gemma3", "layer_types", None),
        ("gemma2", "attn_softcap", None),
        ("gemma2", "logit_softcap", None),
        ("gpt_oss", "layer_types", None),
        ("gpt_oss", "moe", "unclamped"),
        ("olmo3", "layer_types", None),
        ("olmo3", "rope_local_theta", None),
        ("llama4", "attention_chunk", 4096),  # chunks longer than the sequence: nothing cut
        ("llama4", "nope_layers", []),
        ("llama4", "qk_norm", None),
        ("llama4", "attn_temperature_floor", None),
        ("deepseek_v3", "rope_scaling", None),
        ("deepseek_v3", "moe", "unbiased"),
        ("deepseek_v3", "moe", "ungrouped"),
        ("deepseek_v3", "moe", "unshared"),
        ("deepseek_v2", "moe", "unscaled"),
        ("llama4_moe", "moe", "output_scaled"),  # the score weighing the expert's output instead of its input
        ("llama4_moe", "moe", "unshared"),
    ],
)
@torch.no_grad()
def test_each_new_feature_is_computed(family, feature, without):
    """The parity above is not vacuous: each feature of the new families, turned off, changes the logits."""
    hf = build_hf(family)
    config, state = from_hf(hf)
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    if without == "unclamped":  # GPT-OSS's experts with a plain SwiGLU
        without = dataclasses.replace(config.moe, swiglu_limit=None)
    states = [state, state]
    if isinstance(without, str) and without in DEEPSEEK_MOE_OFF:  # one DeepSeekMoE feature off, weights kept
        without, states[1] = DEEPSEEK_MOE_OFF[without](config, state)
    logits = []
    for variant, weights in zip((config, dataclasses.replace(config, **{feature: without})), states, strict=True):
        model = GPT(variant).eval()
        model.load_state_dict(weights, strict=True)
        logits.append(model(ids))
    assert max_diff(logits[0], hf(ids).logits) <= ATOL and max_diff(*logits) > 1e-3


def _unbiased(config, state):
    return config.moe, {k: torch.zeros_like(v) if "e_score" in k else v for k, v in state.items()}


def _unshared(config, state):
    return dataclasses.replace(config.moe, n_shared_experts=0), {k: v for k, v in state.items() if "shared" not in k}


DEEPSEEK_MOE_OFF = {
    "unbiased": _unbiased,
    "ungrouped": lambda config, state: (dataclasses.replace(config.moe, n_group=1, topk_group=1), state),
    "unshared": _unshared,
    "unscaled": lambda config, state: (dataclasses.replace(config.moe, routed_scaling_factor=1.0), state),
    "output_scaled": lambda config, state: (dataclasses.replace(config.moe, input_scaling=False), state),
}
