"""Llama 4 text (Llama4ForCausalLM, Llama4TextConfig) between transformers' config and model.* (issue 50).

Its dense parts are computed: chunked local attention on the blocks with RoPE (attention_chunk_size ->
model.attention_chunk, layer_types chunked_attention), blocks without RoPE (no_rope_layers, 1 = RoPE ->
model.nope_layers), the weightless q/k norm after RoPE on the RoPE blocks (use_qk_norm -> model.qk_norm l2), and
the temperature tuning of the blocks without RoPE (attn_temperature_tuning, floor_scale, attn_scale ->
model.attn_temperature_floor, attn_temperature_scale). Its mixture of experts (a top-1 router whose sigmoid score
scales the expert's input, beside a shared expert) is not: a config with MoE layers is refused by name, on every path
that reads a model (the refusal sits in family_configs.config_from_hf, which they all call).
"""

from __future__ import annotations

from typing import Any

import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig

# Keys that compute nothing without MoE layers (the experts' width and routing) or without temperature tuning.
EXPERT_KEYS = (
    *("intermediate_size", "num_local_experts", "num_experts_per_tok"),
    *("router_aux_loss_coef", "interleave_moe_layer_step"),
)
TEMPERATURE_KEYS = ("floor_scale", "attn_scale")


def llama4_fields(hf: transformers.PretrainedConfig, source: str) -> dict[str, Any]:
    """The model.* fields of a Llama4TextConfig; MoE layers refused."""
    if hf.moe_layers:
        raise DstrainError(
            f"{source}: moe_layers={list(hf.moe_layers)} is not supported: Llama 4's mixture of experts (a sigmoid "
            f"score scaling each expert's input, beside a shared expert) is not implemented; dstrain converts Llama 4 "
            f"text models whose blocks are all dense (moe_layers: [])"
        )
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
    )


def llama4_kwargs(config: GPTConfig) -> dict[str, Any]:
    """The Llama4TextConfig keys of config's Llama 4 features (every block dense)."""
    floor = config.attn_temperature_floor
    return dict(
        intermediate_size=config.ff_dim,
        intermediate_size_mlp=config.ff_dim,
        moe_layers=[],
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
    if key in EXPERT_KEYS:
        return not hf.moe_layers
    if key in TEMPERATURE_KEYS:
        return not hf.attn_temperature_tuning
    return key == "attention_chunk_size" and "chunked_attention" not in hf.layer_types
