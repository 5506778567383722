"""Masked attention: causal, and optionally within packed documents, within a sliding window, with attention
sinks and soft-capped scores. FlexAttention with a block mask where the device runs it forward and backward, else
SDPA with a dense mask.

The mask a layer sees is the intersection of the causal mask, the document mask (documents start where position_ids
is 0) and, on a local layer, the window (a query attends to itself and the window-1 keys before it, by index in the
sequence, as transformers' sliding_window_overlay: under Ulysses the index is the global position, the core attends
over the gathered sequence). Sinks (GPT-OSS) are a learned logit per head that joins each softmax's denominator and
weighs no value, exactly as transformers' eager_attention_forward of GPT-OSS.

The dense mask costs seq² bytes per sample and keeps SDPA off the flash kernel on GPUs (the memory-efficient kernel
takes masks); FlexAttention's block mask stores per 128 x 128 block whether it is empty, full or partial, and its
compiled kernel skips the empty blocks: a local layer of window W costs ~W/L of a global one. torch 2.13 has no
FlexAttention backward on CPU (NotImplementedError), nor a CPU kernel for torch.nn.attention.varlen (flash only), so
CPU training takes the dense mask: which kernel a device gets is probed once per device type (``flex_supported``),
not assumed from its name. Block masks are built once per batch and window and shared by every layer of that kind.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def doc_causal_mask(
    position_ids: torch.Tensor | None, length: int, window: int | None = None, device=None, chunk: int | None = None
):
    """Boolean (B|1, 1, L, L) mask, True = may attend: causal, within the window, within the chunk, within the same
    document."""
    index = torch.arange(length, device=device if position_ids is None else position_ids.device)
    allowed = index[:, None] >= index[None, :]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    if chunk is not None:
        chunk_ids = chunk_of(position_ids, index, chunk)
        allowed = allowed & (chunk_ids[:, :, None] == chunk_ids[:, None, :])
    if position_ids is None:
        return allowed[None, None] if allowed.dim() == 2 else allowed.unsqueeze(1)
    segment = torch.cumsum(position_ids == 0, dim=-1)
    return (allowed & (segment[:, :, None] == segment[:, None, :])).unsqueeze(1)


# --- Llama 4's position-dependent attention (issue 50): chunks and temperature tuning ---


def token_positions(position_ids: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
    """(B|1, L) positions that chunks and temperature count from: within each document with doc masking (the core
    gets position_ids only then, as if each document ran alone), else the index in the sequence, as transformers."""
    return index[None] if position_ids is None else position_ids


def chunk_of(position_ids: torch.Tensor | None, index: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B|1, L) chunk number of each token (transformers' chunked_overlay: same chunk = position // chunk equal)."""
    return torch.div(token_positions(position_ids, index), chunk, rounding_mode="floor")


def temperature_tuned(q: torch.Tensor, position_ids: torch.Tensor | None, floor: int, strength: float) -> torch.Tensor:
    """q (B, L, heads, d) times 1 + strength * ln(1 + floor((position + 1) / floor)) per token: transformers'
    Llama4TextAttention on its blocks without RoPE (attn_temperature_tuning, floor_scale, attn_scale)."""
    index = torch.arange(q.shape[1], device=q.device)
    positions = token_positions(position_ids, index).float()
    scales = torch.log1p(torch.floor((positions + 1.0) / floor)) * strength + 1.0
    return (q * scales[:, :, None, None]).to(q.dtype)


def dense_doc_attention(
    q,
    k,
    v,
    position_ids: torch.Tensor | None,
    window: int | None = None,
    sinks=None,
    scale: float | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """q: (B, heads, L, d), k/v: (B, kv_heads, L, d) -> (B, heads, L, d), through SDPA with the dense mask; with
    sinks (heads,) or a soft cap the scores are materialised (SDPA has neither) as transformers' eager attention of
    GPT-OSS and Gemma 2 compute them."""
    if k.shape[1] != q.shape[1]:  # fused SDPA kernels with an explicit mask do not all take enable_gqa
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = doc_causal_mask(position_ids, q.shape[2], window, q.device, chunk)
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers: no overflow in bf16/fp16
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return probs.to(v.dtype) @ v


def block_mask(
    position_ids: torch.Tensor | None, batch: int, length: int, window: int | None, device, chunk: int | None = None
):
    """FlexAttention's BlockMask: causal, within the window or chunk, within documents (position_ids None: one
    document)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    parts = [causal]
    if window is not None:

        def within_window(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < window

        parts.append(within_window)
    if chunk is not None:
        chunk_ids = chunk_of(position_ids, torch.arange(length, device=device), chunk)
        chunk_rows = chunk_ids.shape[0]

        def within_chunk(b, h, q_idx, kv_idx):
            row = b if chunk_rows > 1 else 0
            return chunk_ids[row, q_idx] == chunk_ids[row, kv_idx]

        parts.append(within_chunk)
    if position_ids is not None:
        segment = torch.cumsum(position_ids == 0, dim=-1)

        def within_document(b, h, q_idx, kv_idx):
            return segment[b, q_idx] == segment[b, kv_idx]

        parts.append(within_document)
    rows = batch if position_ids is not None else None
    return create_block_mask(and_masks(*parts), rows, None, length, length, device=device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # eager FlexAttention materialises the scores


# The block masks of the current batch by window (None = global): every layer of a kind gets the same mask, built
# once per batch (a batch is its position_ids tensor, or without one its length and device).
_cache: dict = {"batch": None, "masks": {}}


def _mask_for(position_ids, batch: int, length: int, window: int | None, device, chunk: int | None = None):
    key = position_ids if position_ids is not None else (batch, length, str(device))
    old = _cache["batch"]
    if not (old is key or (isinstance(old, tuple) and isinstance(key, tuple) and old == key)):
        _cache.update(batch=key, masks={})
    masks = _cache["masks"]
    if (window, chunk) not in masks:
        masks[window, chunk] = block_mask(position_ids, batch, length, window, device, chunk)
    return masks[window, chunk]


def flex_doc_attention(
    q,
    k,
    v,
    position_ids,
    window: int | None = None,
    sinks=None,
    scale: float | None = None,
    softcap: float | None = None,
    compiled: bool = True,
    chunk: int | None = None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    mask = _mask_for(position_ids, q.shape[0], q.shape[2], window, q.device, chunk)
    attend = _compiled_flex() if compiled else flex_attention
    gqa = k.shape[1] != q.shape[1]
    capped = None
    if softcap is not None:

        def capped(score, b, h, q_idx, kv_idx):  # the scaled score, before the mask (Gemma 2)
            return torch.tanh(score / softcap) * softcap

    if sinks is None:
        return attend(q, k, v, score_mod=capped, block_mask=mask, scale=scale, enable_gqa=gqa)
    # A sink adds exp(sink) to the softmax's denominator Z = exp(lse): the output scales by Z / (Z + exp(sink)).
    lse_request = AuxRequest(lse=True)
    out, aux = attend(q, k, v, score_mod=capped, block_mask=mask, scale=scale, enable_gqa=gqa, return_aux=lse_request)
    lse = aux.lse
    return out * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None]).unsqueeze(-1).to(out.dtype)


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


def doc_attention(
    q, k, v, position_ids, window: int | None = None, sinks=None, scale: float | None = None, softcap=None, chunk=None
):
    """Causal attention, within documents when position_ids is given, within the window or chunk, with sinks and
    soft-capped scores: FlexAttention where the device supports it, else the dense mask. Plain causal attention takes
    SDPA's is_causal kernels."""
    if position_ids is None and window is None and sinks is None and softcap is None and chunk is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if flex_supported(q.device.type):
        return flex_doc_attention(q, k, v, position_ids, window, sinks, scale, softcap, chunk=chunk)
    return dense_doc_attention(q, k, v, position_ids, window, sinks, scale, softcap, chunk)
