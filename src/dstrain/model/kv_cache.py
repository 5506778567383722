"""The keys and values a decode keeps per block (model/generate.py): prefill writes the prompts' (left-padded) keys,
each decode step appends one token's, and every query attends to the real keys up to its own.

Rows are left-padded: every row's next token goes at the same column, so one step is one (B, 1) forward. A row's
positions count its real tokens only (``positions``), so a padded prompt sees the RoPE angles and learned positions
it would see alone, and its padding columns are masked out of every softmax (``key_mask``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dstrain.errors import DstrainError
from dstrain.model.config import kv_cache_refusal as refusal


class KVCache:
    """Keys and values of every block, (B, kv_heads, capacity, head_dim) each, filled up to ``length`` columns."""

    def __init__(self, config, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        if (why := refusal(config)) is not None:
            raise DstrainError(why)
        shape = (batch, config.kv_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # real tokens, not padding
        self.length = 0  # columns written by the blocks of the forward before this one
        self.new = 0  # columns the forward in progress writes

    def begin(self, real: torch.Tensor) -> None:
        """A forward of ``real.shape[1]`` new columns starts; ``real`` (B, n) bool says which are tokens."""
        self.length += self.new
        self.new = real.shape[1]
        if self.length + self.new > self.key_mask.shape[1]:
            raise DstrainError(f"the KV cache holds {self.key_mask.shape[1]} tokens; a decode went past it")
        self.key_mask[:, self.length : self.length + self.new] = real

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
        """q (B, heads, n, d), this forward's k, v (B, kv_heads, n, d) stored in block ``layer``; the attention's
        output (B, heads, n, d) over every real key up to each query's column."""
        end = self.length + self.new
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        keys, values = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        if keys.shape[1] != q.shape[1]:  # GQA: SDPA with an explicit mask does not take enable_gqa on every kernel
            keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
            values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
        query_column = torch.arange(self.length, end, device=q.device)[:, None]
        causal = torch.arange(end, device=q.device)[None, :] <= query_column  # (n, end)
        mask = causal[None] & self.key_mask[:, None, :end]  # (B, n, end)
        # A padding query sees no key: give it its own so that its softmax is not 0/0 (its output is never used).
        mask = mask | (~mask.any(-1, keepdim=True) & (torch.arange(end, device=q.device) == query_column)[None])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=scale)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, P), real (B, P) bool): the prompts right-aligned, padded on the left with ``pad_id``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            real[row, width - len(prompt) :] = True
    return ids.to(device), real.to(device)


def positions(real: torch.Tensor) -> torch.Tensor:
    """Each column's position in its row, counting real tokens only (padding gets 0; it is masked anyway)."""
    return (real.long().cumsum(-1) - 1).clamp(min=0)
