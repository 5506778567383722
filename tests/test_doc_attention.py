"""Packed documents without a dense mask: FlexAttention's block mask from position_ids gives the dense-mask SDPA's
attention; a device without FlexAttention's backward (CPU, torch 2.13) trains on the dense mask. The forward and
backward on a GPU, compiled: tests/test_gpu.py::test_flex_doc_attention_equals_the_dense_mask_on_cuda."""

import pytest
import torch

from dstrain.model.doc_attention import dense_doc_attention, doc_attention, flex_doc_attention, flex_supported


def packed(batch: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 16, length: int = 256):
    """q, k, v and position_ids of samples holding documents of several lengths, one crossing a 128-token block."""
    torch.manual_seed(0)
    q = torch.randn(batch, heads, length, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    cuts = [[0, 37, 160, 161, length], [0, 128, 200, length]]
    positions = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(c[:-1], c[1:])]) for c in cuts[:batch]])
    return q, k, v, positions


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: no compiler
def test_flex_block_mask_equals_the_dense_mask_forward_on_cpu():
    q, k, v, positions = packed()
    with torch.no_grad():
        flex = flex_doc_attention(q, k, v, positions, compiled=False)
        dense = dense_doc_attention(q, k, v, positions)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (dense - causal).abs().max() > 1e-2  # the documents really are masked from each other


def test_training_on_cpu_takes_the_dense_mask():
    """torch 2.13 has no FlexAttention backward on CPU; when it gets one, the CPU takes the flex path too."""
    q, k, v, positions = packed()
    assert not flex_supported(q.device.type)
    q.requires_grad_(True)
    out = doc_attention(q, k, v, positions)
    torch.testing.assert_close(out, dense_doc_attention(q, k, v, positions), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_doc_attention(q, k, v, positions, compiled=False)
