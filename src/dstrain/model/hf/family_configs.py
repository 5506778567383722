"""The configs of the llama-flavour families between transformers and model.* (tables: dstrain.model.hf.families).

Nothing a config says is dropped: config_from_hf converts a transformers config, exports the result again and compares
every field the two configs have (``check_round_trip``): a key whose value dstrain would not reproduce (a feature
it does not implement: a bias, soft-capping, a window on a family that does not take it, ...) is refused in one line
on every path that reads a model (from_hf, init_from, eval, generate, export of a HF folder), instead of being computed
as something else. hf_config does the same the other way: what model.* asks that the class cannot express is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, MoEConfig, RopeScaling
from dstrain.model.hf import families
from dstrain.model.hf.family_deepseek import deepseek_fields, deepseek_kwargs
from dstrain.model.hf.family_llama4 import computes_nothing, llama4_fields, llama4_kwargs

# Keys of every transformers config that do not change the function the model computes: bookkeeping, generation,
# initialisation, and dropout and router noise (training-time only; dstrain trains without them, inference never
# applies them).
NEUTRAL = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "use_cache",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "pad_token_id",
    "bos_token_id", "eos_token_id", "initializer_range", "attention_dropout", "resid_pdrop", "embd_pdrop",
    "output_router_logits", "router_jitter_noise",
}  # fmt: skip
NEUTRAL |= {"num_mtp_layers"}  # DeepSeek-V3's multi-token-prediction layers: transformers neither builds nor runs them
# Keys a config's __post_init__ turns into others that are compared (layer_types, no_rope_layers, rope_parameters).
DERIVED = {"max_window_layers", "no_rope_layer_interval", "original_max_position_embeddings"}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> model.mlp_activation


def rope_parameters(config: GPTConfig, local: bool = False) -> dict[str, Any]:
    """transformers' rope_parameters for config (rope_type and rope_theta, then the scaling's own keys); local: those
    of the sliding_attention blocks where rope_local_theta gives them their own."""
    scaling = None if local and config.rope_local_theta is not None else config.rope_scaling
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    partial = {"partial_rotary_factor": config.partial_rotary_factor} if config.family in ("phi3", "glm4_moe") else {}
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta, **partial}
    keys: dict[str, Any] = {
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
    if scaling.type == "llama3":
        keys |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    elif scaling.type == "yarn":
        keys |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
        extra = {"attention_factor": scaling.attention_factor, "mscale": scaling.mscale}
        keys |= {k: v for k, v in (extra | {"mscale_all_dim": scaling.mscale_all_dim}).items() if v is not None}
    elif scaling.type == "longrope":  # factor written out (transformers would derive it from max_position_embeddings)
        keys |= {"long_factor": scaling.long_factor, "short_factor": scaling.short_factor}
        keys |= {} if scaling.attention_factor is None else {"attention_factor": scaling.attention_factor}
    elif scaling.original_max_position_embeddings is None:
        del keys["original_max_position_embeddings"]
    return {"rope_type": scaling.type, "rope_theta": theta, **keys, **partial}


def read_rope(
    rope: dict[str, Any] | None, source: str, max_positions: int | None = None
) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from transformers' rope_parameters; max_positions: the
    config's max_position_embeddings, from which transformers derives a longrope factor the config leaves out."""
    rope = dict(rope or {})
    kind = rope.pop("rope_type", "default")
    rope.pop("type", None)  # the legacy name of rope_type, which Phi-3's config keeps beside it
    theta = float(rope.pop("rope_theta", None) or 10000.0)
    partial = float(rope.pop("partial_rotary_factor", None) or 1.0)
    if kind == "default":
        return theta, None, partial
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(rope) - fields)
    if kind not in ("linear", "llama3", "yarn", "longrope"):
        raise DstrainError(
            f"{source}: rope_parameters.rope_type={kind!r} is not supported; dstrain converts default, linear, "
            f"llama3, yarn and longrope"
        )
    original = rope.get("original_max_position_embeddings")
    if kind == "longrope" and rope.get("factor") is None and max_positions and original:
        rope["factor"] = max_positions / original
    if unknown:
        raise DstrainError(f"{source}: rope_parameters.{unknown[0]} is not supported for rope_type {kind!r}")
    try:
        return theta, RopeScaling(type=kind, **{k: v for k, v in rope.items() if v is not None}), partial
    except DstrainError as e:
        raise DstrainError(f"{source}: {e}") from None


def _rope_fields(hf: transformers.PretrainedConfig, family: str, source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, partial_rotary_factor and rope_local_theta of an HF config."""
    rope = hf.rope_parameters
    local = None
    if family in families.LOCAL_ROPE:  # one rope_parameters per layer type: the local blocks' unscaled, own base
        local_theta, local_scaling, _ = read_rope(rope["sliding_attention"], f"{source} (sliding_attention)")
        if local_scaling is not None:
            raise DstrainError(f"{source}: rope_parameters.sliding_attention is scaled; dstrain scales global blocks")
        local, rope = local_theta, rope["full_attention"]
    theta, scaling, partial = read_rope(rope, source, hf.max_position_embeddings)
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial, rope_local_theta=local)


def _layer_fields(hf: transformers.PretrainedConfig, family: str) -> dict[str, Any]:
    """sliding_window, layer_types and nope_layers of an HF config."""
    fields: dict[str, Any] = {"sliding_window": None, "layer_types": None, "nope_layers": []}
    if family in families.WINDOW_EVERY_BLOCK:
        fields["sliding_window"] = hf.sliding_window
    per_block = family in families.WINDOW_PER_BLOCK
    per_block |= family in families.WINDOW_WHEN_ENABLED and bool(getattr(hf, "use_sliding_window", False))
    if per_block and "sliding_attention" in hf.layer_types:
        fields |= {"sliding_window": hf.sliding_window, "layer_types": list(hf.layer_types)}
    if family == "smollm3":  # HF's no_rope_layers is a mask, 1 = uses RoPE
        fields["nope_layers"] = [i for i, rope in enumerate(hf.no_rope_layers) if not rope]
    return fields


def _moe_fields(hf: transformers.PretrainedConfig, family: str) -> dict[str, Any]:
    if family == "mixtral":
        moe = MoEConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            d_expert=hf.intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
        )
        return {"moe": moe, "d_ff": None}
    if family == "qwen3_moe":
        moe = MoEConfig(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            every=hf.decoder_sparse_step,
            d_expert=hf.moe_intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
            norm_topk_prob=hf.norm_topk_prob,
            dense_layers=list(hf.mlp_only_layers or []),
        )
        return {"moe": moe}
    if family == "gpt_oss":
        moe = MoEConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            d_expert=hf.intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=hf.swiglu_limit,
            swiglu_alpha=hf.swiglu_alpha,
        )
        return {"moe": moe, "d_ff": None}
    return {}


def config_from_hf(hf: transformers.PretrainedConfig, family: str, source: str) -> GPTConfig:
    """Our GPTConfig of a transformers config of a llama-flavour family; what it cannot reproduce is refused."""
    activation = getattr(hf, "hidden_activation", None) or hf.hidden_act
    if activation not in ACTIVATIONS:
        raise DstrainError(f"{source}: hidden_act={activation!r} is not supported; dstrain converts silu, gelu_tanh")
    if getattr(hf, "quantization_config", None):
        raise DstrainError(f"{source}: quantization_config is not supported; convert an unquantised checkpoint")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fixed = {k: v for k, v in families.FIXED[family].items() if k not in ("moe", "mla")}
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    caps = {"attn_softcap": getattr(hf, "attn_logit_softcapping", None)}
    caps["logit_softcap"] = getattr(hf, "final_logit_softcapping", None)
    features = fixed | _rope_fields(hf, family, source) | _layer_fields(hf, family)
    features |= {"d_ff": hf.intermediate_size} | _moe_fields(hf, family) | caps
    features |= llama4_fields(hf, source) if family == "llama4" else {}
    shape = dict(
        n_kv_head=hf.num_key_value_heads or hf.num_attention_heads,
        d_head=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
    )
    try:
        config = GPTConfig(
            flavour="llama",
            family=None if family in ("llama", "mixtral") else family,
            vocab_size=hf.vocab_size,
            max_seq_len=hf.max_position_embeddings,
            n_layer=hf.num_hidden_layers,
            n_head=hf.num_attention_heads,
            d_model=hf.hidden_size,
            tie_embeddings=hf.tie_word_embeddings,
            norm_eps=hf.rms_norm_eps,
            init_std=hf.initializer_range,
            query_pre_attn_scalar=None if scalar is None or scalar == head_dim else float(scalar),
            **(shape | features | deepseek_fields(hf, family)),
        )
    except DstrainError as e:
        raise DstrainError(f"{source}: {e}") from None
    check_round_trip(hf, hf_config(config, None, None, check=False), source)
    return config


def _value(hf: transformers.PretrainedConfig, key: str) -> Any:
    """hf.key with what transformers leaves None resolved, and keys that compute nothing in this config as None."""
    value = getattr(hf, key, None)
    if isinstance(hf, transformers.Llama4TextConfig) and computes_nothing(hf, key):
        return None
    if key == "head_dim" and value is None:
        return hf.hidden_size // hf.num_attention_heads
    if key == "num_key_value_heads" and value is None:
        return hf.num_attention_heads
    if key in ("n_group", "topk_group") and getattr(hf, "topk_method", None) == "greedy":
        return None  # DeepSeek-V2's greedy routing reads no groups
    if key == "rope_parameters" and value is not None:  # compared as what it computes: defaults filled in
        if "full_attention" in value:
            return {kind: read_rope(rope, "", hf.max_position_embeddings) for kind, rope in value.items()}
        return read_rope(value, "", hf.max_position_embeddings)
    kinds = getattr(hf, "layer_types", None)  # None: one window for every block (Mistral, Phi-3)
    sliding = getattr(hf, "use_sliding_window", True) and (kinds is None or "sliding_attention" in kinds)
    if key == "sliding_window" and not sliding:
        return None
    return value


def check_round_trip(hf: transformers.PretrainedConfig, again: transformers.PretrainedConfig, source: str) -> None:
    """Every field of hf that changes the computed function equals the one our conversion exports again."""
    for field in dataclasses.fields(hf):  # transformers' configs are dataclasses
        key = field.name
        if key in NEUTRAL or key in DERIVED:
            continue
        theirs, ours = _value(hf, key), _value(again, key)
        if theirs != ours:
            raise DstrainError(
                f"{source}: {key}={theirs!r} is not supported; dstrain computes this family with {key}={ours!r}"
            )


def hf_config(
    config: GPTConfig, bos_token_id: int | None, eos_token_id: int | None, check: bool = True
) -> transformers.PretrainedConfig:
    """The transformers config of config's family; check: refuse what the class cannot express (a round trip)."""
    family = families.check_exportable(config, "model")
    architecture, config_class = families.CLASSES[family]
    class_fields = {f.name for f in dataclasses.fields(getattr(transformers, config_class))}
    activation = {ours: theirs for theirs, ours in ACTIVATIONS.items()}[config.mlp_activation]
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ff_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tied,
        rope_parameters=rope_parameters(config),
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,  # the tokenizer's own; a class default (Phi-3's 32000) may lie outside a small vocabulary
        architectures=[architecture],
    )
    kwargs["hidden_activation" if "hidden_activation" in class_fields else "hidden_act"] = activation
    kwargs |= {key: False for key in ("attention_bias", "mlp_bias", "use_sliding_window") if key in class_fields}
    if family not in (
        "phi3",
        *families.DEEPSEEK,
    ):  # Phi-3's heads are hidden_size / num_attention_heads wide (not every class lists head_dim)
        kwargs["head_dim"] = config.head_dim
    kwargs |= _layer_kwargs(config, family) | _moe_kwargs(config, family) | deepseek_kwargs(config, family)
    scaling = config.rope_scaling
    if "original_max_position_embeddings" in class_fields and scaling and scaling.original_max_position_embeddings:
        # Phi-3's config keeps it beside rope_parameters, and its own value wins there
        kwargs["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    hf = getattr(transformers, config_class)(**kwargs)
    if check:
        again = config_from_hf(hf, family, "model")
        ours, back = _architecture(config), _architecture(again)
        for key, value in ours.items():
            if back[key] != value:
                raise DstrainError(
                    f"model: {key}={value!r} has no counterpart in {architecture} (it would come back as "
                    f"{back[key]!r}); set model.family to the family this model belongs to, or change {key}"
                )
    return hf


def _layer_kwargs(config: GPTConfig, family: str) -> dict[str, Any]:
    """The HF keys of windows, layer kinds, RoPE per kind and Gemma's attention scale."""
    if family in families.WINDOW_EVERY_BLOCK:
        return {"sliding_window": config.sliding_window}
    if family == "llama4":
        return llama4_kwargs(config)
    kinds = ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.n_layer)]
    out: dict[str, Any] = {}
    if family == "smollm3":
        out["no_rope_layers"] = [int(config.uses_rope(i)) for i in range(config.n_layer)]
    if family in families.WINDOW_WHEN_ENABLED and "sliding_attention" in kinds:  # Qwen2/3, SmolLM3: windows opt in
        out |= dict(use_sliding_window=True, sliding_window=config.sliding_window, layer_types=kinds)
    if family not in families.WINDOW_PER_BLOCK:
        return out
    if family == "gpt_oss":
        return dict(layer_types=kinds, sliding_window=config.sliding_window, attention_bias=True)
    local_rope = {"full_attention": rope_parameters(config), "sliding_attention": rope_parameters(config, True)}
    if family == "olmo3":  # Gemma 3's RoPE per layer type, without Gemma's conventions
        return dict(layer_types=kinds, sliding_window=config.sliding_window, rope_parameters=local_rope)
    scalar = config.query_pre_attn_scalar or config.head_dim
    gemma = dict(
        layer_types=kinds,
        sliding_window=config.sliding_window,
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # transformers types it int
        final_logit_softcapping=config.logit_softcap,
        attn_logit_softcapping=config.attn_softcap,
    )
    if family == "gemma2":  # one rope_parameters; use_bidirectional_attention left at the class's None
        return gemma
    return gemma | dict(rope_parameters=local_rope, use_bidirectional_attention=False)


def _moe_kwargs(config: GPTConfig, family: str) -> dict[str, Any]:
    moe = config.moe
    if family == "mixtral" and moe is not None:
        return dict(
            intermediate_size=config.expert_dim,
            num_local_experts=moe.num_experts,
            router_jitter_noise=0.0,
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coef,
        )
    if family == "qwen3_moe" and moe is not None:
        return dict(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            norm_topk_prob=moe.norm_topk_prob,
            moe_intermediate_size=config.expert_dim,
            decoder_sparse_step=moe.every,
            mlp_only_layers=list(moe.dense_layers),
            router_aux_loss_coef=moe.aux_loss_coef,
        )
    if family == "gpt_oss" and moe is not None:
        return dict(
            intermediate_size=config.expert_dim,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coef,
            swiglu_limit=moe.swiglu_limit,
            swiglu_alpha=moe.swiglu_alpha,
        )
    return {}


def _architecture(config: GPTConfig) -> dict[str, Any]:
    """config's fields that decide the computed function, each in one form (windows per block; defaults resolved)."""
    fields = dataclasses.asdict(config)
    for key in ("doc_masking", "init_std", "layer_types", "sliding_window", "family", "attention_chunk"):
        del fields[key]
    if fields["moe"] is not None:
        del fields["moe"]["z_loss_coef"]  # a training choice transformers does not record
        del fields["moe"]["bias_update_rate"]  # the same (DeepSeek's balancing rate)
        del fields["moe"]["aux_loss_kind"]  # the same (batch- or sequence-wise balancing loss)
        if config.resolved_family in families.DEEPSEEK_MOE:  # their classes record no auxiliary-loss weight either
            del fields["moe"]["aux_loss_coef"]
        fields["moe"]["d_expert"] = config.expert_dim
    fields |= dict(
        windows=[config.window(i) for i in range(config.n_layer)],
        chunks=[config.chunk(i) for i in range(config.n_layer)],
        query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
        rope_local_theta=config.rope_local_theta or config.rope_theta,
        d_head=config.head_dim,
        n_kv_head=config.kv_heads,
        tie_embeddings=config.tied,
        d_ff=config.expert_dim if config.moe is not None and config.family in (None, "gpt_oss") else config.ff_dim,
    )
    return fields
