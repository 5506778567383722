"""dstrain.model.hf.convert: our GPT and the Hugging Face model built by to_hf compute the same function."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.errors import DstrainError  # noqa: E402
from dstrain.model.config import GPTConfig  # noqa: E402
from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.hf.convert import from_hf, to_hf  # noqa: E402

VOCAB = 101
ATOL = 1e-4
# Every field explicit, so the config survives the round trip field for field.
CONFIGS = {
    "gpt2": GPTConfig(
        flavour="gpt2",
        vocab_size=VOCAB,
        max_seq_len=32,
        n_layer=2,
        n_head=4,
        n_kv_head=4,
        d_model=32,
        d_ff=128,
        tie_embeddings=True,
        norm_eps=1e-5,
        init_std=0.2,
    ),
    "llama": GPTConfig(
        flavour="llama",
        vocab_size=VOCAB,
        max_seq_len=32,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        d_ff=96,
        tie_embeddings=False,
        norm_eps=1e-6,
        rope_theta=500.0,
        init_std=0.2,
    ),
}
HF_CLASSES = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}


@pytest.fixture(params=["gpt2", "llama"])
def pair(request):
    """(flavour, our model, the HF model loaded from to_hf), both in eval mode."""
    flavour = request.param
    torch.manual_seed(0)
    ours = GPT(dataclasses.replace(CONFIGS[flavour])).eval()  # a copy: tests may flip doc_masking
    # Perturb norms so that a swapped or dropped norm/bias would show in the logits.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf_config, hf_state = to_hf(ours.config, ours.state_dict(), bos_token_id=0, eos_token_id=1)
    assert hf_config.architectures == [HF_CLASSES[flavour].__name__]
    hf_config._attn_implementation = "sdpa"
    hf = HF_CLASSES[flavour](hf_config).eval()
    hf.load_state_dict(hf_state, strict=True)
    return flavour, ours, hf


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_same_logits(pair):
    _, ours, hf = pair
    ids = torch.randint(0, VOCAB, (2, 20))
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL
    # dropout in the exported config is 0, so train mode computes the same function
    ours.train(), hf.train()
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL


@torch.no_grad()
def test_same_logits_with_position_ids(pair):
    _, ours, hf = pair
    ids = torch.randint(0, VOCAB, (2, 20))
    position_ids = torch.cat([torch.arange(7), torch.arange(13)]).expand(2, -1)
    # An explicit all-ones attention_mask keeps HF on the plain causal mask: positions reset, attention does not.
    plain = hf(ids, position_ids=position_ids, attention_mask=torch.ones_like(ids)).logits
    assert max_diff(ours(ids, position_ids), plain) <= ATOL
    assert max_diff(plain, hf(ids).logits) > 1e-3  # the positions did matter
    # Without a mask (and no cache) HF detects packed documents from position_ids: our doc_masking.
    packed = hf(ids, position_ids=position_ids, use_cache=False).logits
    ours.config.doc_masking = True
    assert max_diff(ours(ids, position_ids), packed) <= ATOL


def test_round_trip_is_identical(pair, tmp_path):
    flavour, ours, hf = pair
    for source in (hf, tmp_path):
        if source is tmp_path:
            hf.save_pretrained(tmp_path)
        config, state = from_hf(source)
        assert config == CONFIGS[flavour]
        assert state.keys() == ours.state_dict().keys()
        for name, tensor in ours.state_dict().items():
            assert torch.equal(state[name], tensor), name
        GPT(config).load_state_dict(state, strict=True)


@torch.no_grad()
def test_hf_generate_matches_our_greedy_decoding(pair):
    _, ours, hf = pair
    prompt = torch.randint(2, VOCAB, (2, 5))
    generated = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=1
    )
    assert generated.shape == (2, 11)
    tokens = prompt
    for _ in range(6):
        tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


def test_unsupported_architecture_is_named(tmp_path):
    transformers.PhiConfig(architectures=["PhiForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(DstrainError, match="PhiForCausalLM") as error:
        from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)
    with pytest.raises(DstrainError, match="no such file"):
        from_hf(tmp_path / "missing")


def test_unsupported_llama_feature_is_named():
    hf_config, hf_state = to_hf(CONFIGS["llama"], GPT(CONFIGS["llama"]).state_dict())
    hf_config.attention_bias = True
    with pytest.raises(DstrainError, match="attention_bias=True"):
        from_hf(transformers.LlamaForCausalLM(hf_config))
