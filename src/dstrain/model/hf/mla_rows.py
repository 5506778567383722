"""The rotated rows of DeepSeek's latent attention between transformers' layout and ours.

DeepSeek checkpoints lay each head's RoPE dimensions out in pairs (x0, x1), (x2, x3), ... (DeepSeek-V3's
rope_interleave, DeepSeek-V2's complex rotation); dstrain rotates halves (x0..x_{r/2-1} with x_{r/2}..), as for every
other family. Permuting the rope rows of the query projection (each head's last qk_rope_head_dim rows) and of
kv_a_proj_with_mqa (its last qk_rope_head_dim rows) to evens-then-odds makes the two compute the same attention
scores: transformers' interleaved rotation returns its result in that evens-then-odds order for both q and k.
"""

from __future__ import annotations

import torch

from dstrain.model.config import GPTConfig
from dstrain.model.gpt import StateDict


def _order(rope: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def permute_rope_rows(config: GPTConfig, state: StateDict, to_hf: bool) -> StateDict:
    """state (our names) with the rope rows de-interleaved (from HF), or interleaved again (to_hf)."""
    mla = config.mla
    if mla is None or not mla.rope_interleave:
        return state
    order = _order(mla.qk_rope_head_dim)
    if to_hf:
        order = torch.argsort(order)
    out = dict(state)
    for i in range(config.n_layer):
        attn = f"blocks.{i}.self_attn"
        query = f"{attn}.q_proj.weight" if mla.q_lora_rank is None else f"{attn}.q_b_proj.weight"
        heads = state[query].view(config.n_head, mla.qk_head_dim, -1)
        nope, rope = heads.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=1)
        out[query] = torch.cat([nope, rope[:, order]], dim=1).reshape(state[query].shape)
        kv = state[f"{attn}.kv_a_proj_with_mqa.weight"]
        latent, rope = kv.split([mla.kv_lora_rank, mla.qk_rope_head_dim])
        out[f"{attn}.kv_a_proj_with_mqa.weight"] = torch.cat([latent, rope[order]])
    return out
