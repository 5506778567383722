"""DeepSeek's multi-head latent attention (model.mla; DeepSeek-V2 section 2.1), as transformers' DeepseekV3Attention
computes it, with its weights under the same names:

    q_proj                                   d -> heads * (nope + rope)       (no q_lora_rank: DeepSeek-V2-Lite)
    q_a_proj, q_a_layernorm, q_b_proj        d -> q_lora_rank -> RMSNorm -> heads * (nope + rope)
    kv_a_proj_with_mqa                       d -> kv_lora_rank + rope         (the latent, and one rotated key part)
    kv_a_layernorm, kv_b_proj                RMSNorm(latent) -> heads * (nope + v)
    o_proj                                   heads * v -> d

Each head's key is its own nope part beside the rope part all heads share; RoPE (model/rope.py, on rotary_dim =
qk_rope_head_dim, with DeepSeek's YaRN) turns only the rope parts. The softmax scale is qk_head_dim**-0.5, times
mscale(factor, mscale_all_dim)**2 under YaRN (transformers' yarn_apply_mscale). The core is the model's CoreAttention
(doc masking, sequence parallelism wrap it as for every attention): q and k qk_head_dim wide, v v_head_dim wide.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dstrain.model.config import GPTConfig
from dstrain.model.layers import Linear, apply_rope
from dstrain.model.rope import rope_cos_sin

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps


def softmax_scale(config: GPTConfig) -> float:
    """qk_head_dim**-0.5, with YaRN's mscale_all_dim correction squared (DeepSeek's yarn_get_mscale)."""
    assert config.mla is not None
    scale, rope = config.mla.qk_head_dim**-0.5, config.rope_scaling
    if rope is not None and rope.type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, config: GPTConfig, core: nn.Module) -> None:
        """core: the block's CoreAttention (model/gpt.py), which scales by softmax_scale with model.mla."""
        super().__init__()
        assert config.mla is not None
        mla, d, std, heads = config.mla, config.d_model, config.init_std, config.n_head
        self.config, self.mla = config, mla
        if mla.q_lora_rank is None:
            self.q_proj = Linear(d, heads * mla.qk_head_dim, False, std)
        else:
            self.q_a_proj = Linear(d, mla.q_lora_rank, False, std)
            self.q_a_layernorm = nn.RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, False, std)
        self.kv_a_proj_with_mqa = Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, False, std)
        self.kv_a_layernorm = nn.RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False, std)
        self.o_proj = Linear(heads * mla.v_head_dim, d, False, std / math.sqrt(2 * config.n_layer))
        self.core = core

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        mla = self.mla
        # (B, L, heads, dim) throughout: the layout the core (and sequence parallelism) takes.
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(batch, length, -1, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, length, -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        positions = position_ids if position_ids is not None else torch.arange(length, device=x.device)[None]
        cos, sin = rope_cos_sin(positions, self.config, q.dtype)
        q_rope = apply_rope(q_rope.transpose(1, 2), cos, sin).transpose(1, 2)
        k_rope = apply_rope(k_rope.view(batch, 1, length, -1), cos, sin).transpose(1, 2)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        y = self.core(q, k, v.contiguous(), position_ids)
        return self.o_proj(y.reshape(batch, length, -1))
