"""The configs of DeepSeek's families between transformers and model.*: latent attention (model.mla, model/mla.py)
and DeepSeekMoE (model.moe: scoring, groups, shared experts, routed_scaling_factor; model/moe.py). Called by
dstrain.model.hf.family_configs, whose round trip refuses what these do not convert."""

from __future__ import annotations

from typing import Any

import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, MLAConfig, MoEConfig
from dstrain.model.hf import families


def deepseek_fields(hf: transformers.PretrainedConfig, family: str) -> dict[str, Any]:
    """model.mla and model.moe of a DeepseekV3Config or DeepseekV2Config; GLM-4.5's model.moe and attention."""
    if family == "glm4_moe":
        return glm4_moe_fields(hf)
    if family not in families.DEEPSEEK:
        return {}
    mla = MLAConfig(
        kv_lora_rank=hf.kv_lora_rank,
        q_lora_rank=hf.q_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=True if family == "deepseek_v2" else bool(hf.rope_interleave),  # V2: complex pairs
    )
    v3 = family == "deepseek_v3"
    grouped = v3 or hf.topk_method == "group_limited_greedy"
    moe = MoEConfig(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        d_expert=hf.moe_intermediate_size,
        dense_layers=list(range(min(hf.first_k_dense_replace or 0, hf.num_hidden_layers))),
        scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(hf.norm_topk_prob) if v3 else False,  # transformers' V2 router never renormalises
        router_fp32=True,
        n_group=hf.n_group or 1 if grouped else 1,
        topk_group=hf.topk_group or 1 if grouped else 1,
        routed_scaling_factor=hf.routed_scaling_factor,
        n_shared_experts=hf.n_shared_experts,
        aux_loss_coef=0.0,  # DeepSeek-V3 balances with the bias (bias_update_rate), V2's loss is not recorded
        bias_update_rate=0.001 if v3 else 0.0,  # DeepSeek-V3 section 2.1.2's rate
    )
    return dict(mla=mla, moe=moe, n_kv_head=None, d_head=None)


def deepseek_kwargs(config: GPTConfig, family: str) -> dict[str, Any]:
    mla, moe = config.mla, config.moe
    if family == "glm4_moe" and moe is not None:
        glm = dict(attention_bias=config.qkv_bias, use_qk_norm=config.qk_norm == "head")
        return _routing_kwargs(config, family) | glm
    if family not in families.DEEPSEEK or mla is None or moe is None:
        return {}
    out = _routing_kwargs(config, family) | dict(
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        attention_bias=False,
    )
    if family == "deepseek_v3":
        return out | dict(rope_interleave=mla.rope_interleave)
    return out | dict(topk_method="group_limited_greedy" if moe.n_group > 1 else "greedy", mlp_bias=False)


def _routing_kwargs(config: GPTConfig, family: str) -> dict[str, Any]:
    """DeepSeekMoE's keys, the same in DeepSeek-V2/V3's and GLM-4.5's configs."""
    moe = config.moe
    assert moe is not None
    if moe.every != 1 or moe.dense_layers != list(range(len(moe.dense_layers))):
        raise DstrainError(
            f"model.moe: {families.CLASSES[family][0]} keeps only its first blocks dense (first_k_dense_replace); "
            f"set every: 1 and dense_layers: [0, 1, ...]"
        )
    return dict(
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=config.expert_dim,
        first_k_dense_replace=len(moe.dense_layers),
        norm_topk_prob=moe.norm_topk_prob,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        n_shared_experts=moe.n_shared_experts,
    )


def glm4_moe_fields(hf: transformers.PretrainedConfig) -> dict[str, Any]:
    """GLM-4.5's model.moe (DeepSeek-V3's router and shared experts) and its attention's biases and q/k norms."""
    moe = MoEConfig(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        d_expert=hf.moe_intermediate_size,
        dense_layers=list(range(min(hf.first_k_dense_replace or 0, hf.num_hidden_layers))),
        scoring="sigmoid",
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_fp32=True,
        n_group=hf.n_group or 1,
        topk_group=hf.topk_group or 1,
        routed_scaling_factor=hf.routed_scaling_factor,
        n_shared_experts=hf.n_shared_experts,
        aux_loss_coef=0.0,
        bias_update_rate=0.001,
    )
    return dict(moe=moe, qkv_bias=bool(hf.attention_bias), qk_norm="head" if hf.use_qk_norm else None)
