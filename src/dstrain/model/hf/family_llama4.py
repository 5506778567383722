"""Llama 4 text (Llama4ForCausalLM, Llama4TextConfig) between transformers' config and model.* (issue 50).

Computed: chunked local attention on the blocks with RoPE (attention_chunk_size -> model.attention_chunk,
layer_types chunked_attention), blocks without RoPE (no_rope_layers, 1 = RoPE -> model.nope_layers), the weightless
q/k norm after RoPE on the RoPE blocks (use_qk_norm -> model.qk_norm l2), the temperature tuning of the blocks without
RoPE (attn_temperature_tuning, floor_scale, attn_scale -> model.attn_temperature_floor, attn_temperature_scale), and
the mixture of experts of the blocks in moe_layers (transformers' Llama4TextMoe -> model.moe with input_scaling: a
top-1 router whose sigmoid score scales the chosen expert's input, one shared expert of the experts' width beside;
the other blocks' MLP is intermediate_size_mlp wide -> model.d_ff).
"""

from __future__ import annotations

from typing import Any

import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, MoEConfig

# Keys that compute nothing without MoE layers (the experts' width and routing) or without temperature tuning.
EXPERT_KEYS = (
    *("intermediate_size", "num_local_experts", "num_experts_per_tok"),
    *("router_aux_loss_coef", "interleave_moe_layer_step"),
)
TEMPERATURE_KEYS = ("floor_scale", "attn_scale")


def llama4_fields(hf: transformers.PretrainedConfig, source: str) -> dict[str, Any]:
    """The model.* fields of a Llama4TextConfig."""
    kinds = list(hf.layer_types)
    chunked = "chunked_attention" in kinds
    tuned = bool(hf.attn_temperature_tuning)
    return dict(
        d_ff=hf.intermediate_size_mlp,
        qk_norm="l2" if hf.use_qk_norm else None,
        layer_types=kinds if chunked else None,
        attention_chunk=hf.attention_chunk_size if chunked else None,
        nope_layers=[i for i, rope in enumerate(hf.no_rope_layers) if not rope],
        attn_temperature_floor=int(hf.floor_scale) if tuned else None,
        attn_temperature_scale=float(hf.attn_scale) if tuned else 0.1,
        moe=_llama4_moe(hf, source),
    )


def _llama4_moe(hf: transformers.PretrainedConfig, source: str) -> MoEConfig | None:
    """model.moe of the blocks in moe_layers: every interleave_moe_layer_step-th block where moe_layers is that
    pattern less some blocks (dense_layers), else every block but those not listed. Top-1 only."""
    if not hf.moe_layers:
        return None
    if hf.num_experts_per_tok != 1:
        raise DstrainError(
            f"{source}: num_experts_per_tok={hf.num_experts_per_tok} is not supported: dstrain computes Llama 4's "
            f"experts top-1 (its published models), where the score scales the one chosen expert's input"
        )
    layers, step = set(hf.moe_layers), hf.interleave_moe_layer_step
    pattern = {i for i in range(hf.num_hidden_layers) if (i + 1) % step == 0}
    every = step if layers <= pattern else 1
    candidates = pattern if every == step else set(range(hf.num_hidden_layers))
    return MoEConfig(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        every=every,
        d_expert=hf.intermediate_size,
        dense_layers=sorted(candidates - layers),
        aux_loss_coef=hf.router_aux_loss_coef,
        n_shared_experts=1,
        input_scaling=True,
    )


def llama4_kwargs(config: GPTConfig) -> dict[str, Any]:
    """The Llama4TextConfig keys of config's Llama 4 features."""
    floor, moe = config.attn_temperature_floor, config.moe
    experts: dict[str, Any] = {}
    if moe is not None:
        experts = dict(
            num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k, interleave_moe_layer_step=moe.every
        )
        experts["router_aux_loss_coef"] = moe.aux_loss_coef
    return experts | dict(
        intermediate_size=config.expert_dim if moe is not None else config.ff_dim,
        intermediate_size_mlp=config.ff_dim,
        moe_layers=[i for i in range(config.n_layer) if config.is_moe_block(i)],
        use_qk_norm=config.qk_norm == "l2",
        layer_types=["chunked_attention" if config.chunk(i) else "full_attention" for i in range(config.n_layer)],
        attention_chunk_size=config.attention_chunk,
        no_rope_layers=[int(config.uses_rope(i)) for i in range(config.n_layer)],
        attn_temperature_tuning=floor is not None,
        floor_scale=8192 if floor is None else floor,
        attn_scale=config.attn_temperature_scale,
    )


def computes_nothing(hf: transformers.PretrainedConfig, key: str) -> bool:
    """Whether key of a Llama4TextConfig computes nothing in this config (compared as None by the round trip)."""
    if key == "interleave_moe_layer_step":
        return True  # read into moe_layers by the config itself, which is compared
    if key in EXPERT_KEYS:
        return not hf.moe_layers
    if key in TEMPERATURE_KEYS:
        return not hf.attn_temperature_tuning
    return key == "attention_chunk_size" and "chunked_attention" not in hf.layer_types
