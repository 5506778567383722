"""Attention within packed documents: FlexAttention with a block mask built from position_ids where the device runs
it forward and backward, else SDPA with a dense boolean mask.

The dense mask costs seq² bytes per sample and keeps SDPA off the flash kernel on GPUs (the memory-efficient kernel
takes masks); FlexAttention's block mask stores per 128 x 128 block whether it is empty, full or partial, and its
compiled kernel skips the empty blocks. torch 2.13 has no FlexAttention backward on CPU (NotImplementedError), nor a
CPU kernel for torch.nn.attention.varlen (flash only), so CPU training takes the dense mask: which kernel a device
gets is probed once per device type (``flex_supported``), not assumed from its name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def doc_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, L, L) mask, True = may attend: causal and within the same document."""
    segment = torch.cumsum(position_ids == 0, dim=-1)
    same_doc = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def dense_doc_attention(q, k, v, position_ids: torch.Tensor) -> torch.Tensor:
    """q: (B, heads, L, d), k/v: (B, kv_heads, L, d) -> (B, heads, L, d), through SDPA with the dense mask."""
    if k.shape[1] != q.shape[1]:  # fused SDPA kernels with an explicit mask do not all take enable_gqa
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=doc_causal_mask(position_ids))


def block_mask(position_ids: torch.Tensor):
    """FlexAttention's BlockMask for causal attention within documents (a document starts where position_ids is 0)."""
    from torch.nn.attention.flex_attention import create_block_mask

    segment = torch.cumsum(position_ids == 0, dim=-1)

    def within_document(b, h, q_idx, kv_idx):
        return (segment[b, q_idx] == segment[b, kv_idx]) & (q_idx >= kv_idx)

    batch, length = position_ids.shape
    return create_block_mask(within_document, batch, None, length, length, device=position_ids.device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # eager FlexAttention materialises the scores


_last_mask: list = [None, None]  # (position_ids, its BlockMask): every block of one forward gets the same tensor


def flex_doc_attention(q, k, v, position_ids: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if _last_mask[0] is not position_ids:
        _last_mask[:] = [position_ids, block_mask(position_ids)]
    attend = _compiled_flex() if compiled else flex_attention
    return attend(q, k, v, block_mask=_last_mask[1], enable_gqa=k.shape[1] != q.shape[1])


@functools.cache
def flex_supported(device_type: str) -> bool:
    """Whether FlexAttention runs forward and backward on this kind of device (one tiny probe per process)."""
    from torch.nn.attention.flex_attention import flex_attention

    try:
        q = torch.randn(1, 1, 128, 16, device=device_type, requires_grad=True)
        flex_attention(q, q, q).sum().backward()  # eager and without a mask: a probe compiles nothing
    except (NotImplementedError, RuntimeError):  # no backward on this device, or no compiler backend for it
        return False
    return True


def doc_attention(q, k, v, position_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents: FlexAttention where the device supports it, else the dense mask."""
    if flex_supported(q.device.type):
        return flex_doc_attention(q, k, v, position_ids)
    return dense_doc_attention(q, k, v, position_ids)
