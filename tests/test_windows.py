"""Local attention, sinks and layers without RoPE (model.layer_types, sliding_window, attention_sinks, nope_layers):
the masks FlexAttention and the dense path build are the intersection of causal, document and window masks; sinks are
transformers' GPT-OSS eager attention; a window shorter than the sequence really cuts. Families that use them:
tests/test_families.py."""

from __future__ import annotations

import os
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_doc_attention import packed  # noqa: E402
from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

from dstrain.errors import DstrainError  # noqa: E402
from dstrain.model.config import GPTConfig  # noqa: E402
from dstrain.model.doc_attention import dense_doc_attention, doc_causal_mask, flex_doc_attention  # noqa: E402

WINDOW = 50  # crosses FlexAttention's 128-token blocks in the 256-token samples of `packed`


def test_window_mask_is_transformers_sliding_window():
    length = 40
    mask = doc_causal_mask(None, length, window=7)[0, 0]
    theirs = sliding_window_causal_mask_function(7)
    index = torch.arange(length)
    expected = torch.stack([torch.stack([theirs(0, 0, q, k) for k in index]) for q in index])
    assert torch.equal(mask, expected) and mask.sum() < doc_causal_mask(None, length)[0, 0].sum()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: no compiler
@pytest.mark.parametrize("documents", [True, False], ids=["packed", "one-document"])
@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no-sinks"])
@pytest.mark.parametrize("softcap", [None, 1.0], ids=["uncapped", "softcap"])
def test_flex_window_and_sinks_equal_the_dense_mask_forward_on_cpu(documents, sinks, softcap):
    q, k, v, positions = packed()
    positions = positions if documents else None
    sink = torch.randn(q.shape[1]) if sinks else None
    with torch.no_grad():
        flex = flex_doc_attention(q, k, v, positions, WINDOW, sink, softcap=softcap, compiled=False)
        dense = dense_doc_attention(q, k, v, positions, WINDOW, sink, softcap=softcap)
        unwindowed = dense_doc_attention(q, k, v, positions, None, sink, softcap=softcap)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    assert (dense - unwindowed).abs().max() > 1e-2  # the window cut


def test_sinks_are_transformers_gpt_oss_eager_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, -1)
    sinks = torch.randn(q.shape[1])
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    mask = doc_causal_mask(positions, 40, window=9)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=q.shape[-1] ** -0.5)
    ours = dense_doc_attention(q, k, v, positions, 9, sinks)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=1e-6)
    assert (ours - dense_doc_attention(q, k, v, positions, 9)).abs().max() > 1e-2  # the sinks mattered


def test_layer_kinds_are_checked_and_resolved():
    config = GPTConfig(
        flavour="llama",
        n_layer=3,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        nope_layers=[1],
    )
    assert [config.window(i) for i in range(3)] == [8, None, 8]
    assert [config.uses_rope(i) for i in range(3)] == [True, False, True]
    assert GPTConfig(flavour="llama", n_layer=2, sliding_window=8).window(1) == 8  # Mistral: every block local
    with pytest.raises(DstrainError, match="model.layer_types: 1 kinds for n_layer=3"):
        GPTConfig(flavour="llama", n_layer=3, sliding_window=8, layer_types=["full_attention"])
    with pytest.raises(DstrainError, match="model.layer_types: sliding_attention blocks need a window"):
        GPTConfig(flavour="llama", n_layer=1, layer_types=["sliding_attention"])
    with pytest.raises(DstrainError, match="model.nope_layers: block 3 does not exist"):
        GPTConfig(flavour="llama", n_layer=3, nope_layers=[3])


def test_a_local_block_costs_its_window_in_attention_flops():
    """flops_per_token (MFU, `dstrain plan`'s step times) counts a local block's L x W band, not the L x L square."""
    from dstrain.model.counts import flops_per_token

    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    local = GPTConfig(flavour="llama", n_layer=3, n_head=4, d_model=64, sliding_window=100, layer_types=kinds)
    full = GPTConfig(flavour="llama", n_layer=3, n_head=4, d_model=64)
    seq = 1000
    assert flops_per_token(full, seq) - flops_per_token(local, seq) == 12 * 4 * 16 * (seq - 100) * 2
    assert flops_per_token(full, 50) == flops_per_token(local, 50)  # a window longer than the sequence cuts nothing


# --- Llama 4's chunked attention (issue 50) ---


def test_chunk_mask_is_transformers_chunked_mask_and_restarts_with_each_document():
    from transformers.masking_utils import chunked_causal_mask_function

    length, chunk = 40, 7
    mask = doc_causal_mask(None, length, chunk=chunk)[0, 0]
    theirs = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))
    index = torch.arange(length)
    expected = torch.stack([torch.stack([theirs(0, 0, q, k) for k in index]) for q in index])
    assert torch.equal(mask, expected) and mask.sum() < doc_causal_mask(None, length)[0, 0].sum()
    # packed: the second document's chunks count from its own start, as if it ran alone
    positions = torch.cat([torch.arange(12), torch.arange(28)])[None]
    packed_mask = doc_causal_mask(positions, length, chunk=chunk)[0, 0]
    assert torch.equal(packed_mask[12:, 12:], doc_causal_mask(None, 28, chunk=chunk)[0, 0])
    assert not packed_mask[12:, :12].any()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: no compiler
@pytest.mark.parametrize("documents", [True, False], ids=["packed", "one-document"])
def test_flex_chunks_equal_the_dense_mask_forward_on_cpu(documents):
    q, k, v, positions = packed()
    positions = positions if documents else None
    with torch.no_grad():
        flex = flex_doc_attention(q, k, v, positions, None, compiled=False, chunk=WINDOW)
        dense = dense_doc_attention(q, k, v, positions, None, chunk=WINDOW)
        unchunked = dense_doc_attention(q, k, v, positions, None)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    assert (dense - unchunked).abs().max() > 1e-2  # the chunks cut


def test_flops_count_a_chunked_block_over_its_chunk():
    """flops_per_token: a chunked block's queries see min(C, L) keys each, as a local block's see min(W, L)."""
    from dstrain.model.counts import flops_per_token, num_params

    kinds = ["chunked_attention", "full_attention"]
    config = GPTConfig(flavour="llama", n_layer=2, layer_types=kinds, attention_chunk=64, qk_norm="l2")
    n = num_params(config, exclude_embeddings=True, active=True)
    assert num_params(config) == num_params(GPTConfig(flavour="llama", n_layer=2))  # the l2 q/k norm has no weight
    assert flops_per_token(config, 1024) == 6 * n + 12 * config.n_head * config.head_dim * (64 + 1024)
    assert flops_per_token(config, 32) == 6 * n + 12 * config.n_head * config.head_dim * (32 + 32)
    with pytest.raises(DstrainError, match="model.layer_types: chunked_attention blocks need a chunk size"):
        GPTConfig(flavour="llama", n_layer=2, layer_types=kinds)
    with pytest.raises(DstrainError, match="model.attention_chunk: no block is chunked_attention"):
        GPTConfig(flavour="llama", n_layer=2, attention_chunk=64)
    with pytest.raises(DstrainError, match="attn_temperature_floor need 'llama'"):
        GPTConfig(flavour="gpt2", n_layer=2, attn_temperature_floor=8)
