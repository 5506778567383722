"""The published llama-flavour families: the transformers class each one is, how its config maps onto model.*
fields, and the names of its weights inside one decoder layer. dstrain.model.hf converts with these tables.

| family    | transformers class   | features (model.* fields)                                                     |
|-----------|----------------------|-------------------------------------------------------------------------------|
| llama     | LlamaForCausalLM     | rope_scaling (Llama 3.x: llama3)                                              |
| mistral   | MistralForCausalLM   | sliding_window (refused when shorter than data.seq_len)                       |
| qwen2     | Qwen2ForCausalLM     | qkv_bias (Qwen2 and Qwen2.5)                                                  |
| qwen3     | Qwen3ForCausalLM     | qk_norm head, d_head                                                          |
| olmo2     | Olmo2ForCausalLM     | qk_norm projection, norm_placement post                                       |
| mixtral   | MixtralForCausalLM   | moe (every 1)                                                                 |
| qwen3_moe | Qwen3MoeForCausalLM  | qk_norm head, d_head, moe: norm_topk_prob, every, dense_layers                  |

Qwen3-MoE's decoder_sparse_step is moe.every, its mlp_only_layers moe.dense_layers, moe_intermediate_size d_expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, MoEConfig, RopeScaling

# family -> (transformers model class, its config class)
CLASSES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
}
ARCHITECTURE_FAMILY = {architecture: family for family, (architecture, _) in CLASSES.items()}
# The model.* features each family's class has fixed (an export to it must match them).
FIXED: dict[str, dict[str, Any]] = {
    "llama": {"qkv_bias": False, "qk_norm": None, "norm_placement": "pre", "sliding_window": None, "moe": False},
    "mistral": {"qkv_bias": False, "qk_norm": None, "norm_placement": "pre", "moe": False},
    "qwen2": {"qkv_bias": True, "qk_norm": None, "norm_placement": "pre", "sliding_window": None, "moe": False},
    "qwen3": {"qkv_bias": False, "qk_norm": "head", "norm_placement": "pre", "sliding_window": None, "moe": False},
    "olmo2": {
        "qkv_bias": False,
        "qk_norm": "projection",
        "norm_placement": "post",
        "sliding_window": None,
        "moe": False,
    },
    "mixtral": {"qkv_bias": False, "qk_norm": None, "norm_placement": "pre", "moe": True},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": "head", "norm_placement": "pre", "sliding_window": None, "moe": True},
}
SLIDING_KEY = {"qwen2", "qwen3", "qwen3_moe"}  # families whose config has use_sliding_window (must be false)


def check_exportable(config: GPTConfig, source: str) -> str:
    """The family's name, once config's features are what its transformers class computes."""
    family = config.resolved_family
    for key, value in FIXED[family].items():
        ours = (config.moe is not None) if key == "moe" else getattr(config, key)
        if ours != value:
            raise DstrainError(
                f"{source}: model.{key}={ours!r} has no counterpart in {CLASSES[family][0]} (model.family "
                f"{family!r} has {key} {value!r}); set model.family to the family this model belongs to"
            )
    moe = config.moe
    if family == "mixtral" and moe is not None and (moe.every != 1 or moe.dense_layers or not moe.norm_topk_prob):
        raise DstrainError(
            f"{source}: MixtralForCausalLM needs model.moe.every 1, no dense_layers and norm_topk_prob true; "
            f"set model.family: qwen3_moe for other MoE layouts"
        )
    return family


def rope_parameters(config: GPTConfig) -> dict[str, Any]:
    """transformers' rope_parameters for config (rope_type and rope_theta, then the scaling's own keys)."""
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    keys = {"factor": scaling.factor, "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if scaling.type == "llama3":
        keys |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    elif scaling.type == "yarn":
        keys |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
        extra = {"attention_factor": scaling.attention_factor, "mscale": scaling.mscale}
        keys |= {k: v for k, v in (extra | {"mscale_all_dim": scaling.mscale_all_dim}).items() if v is not None}
    elif scaling.original_max_position_embeddings is None:
        del keys["original_max_position_embeddings"]
    return {"rope_type": scaling.type, "rope_theta": config.rope_theta, **keys}


def read_rope(rope: dict[str, Any] | None, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from transformers' rope_parameters."""
    rope = dict(rope or {})
    kind = rope.pop("rope_type", "default")
    theta = float(rope.pop("rope_theta", None) or 10000.0)
    if kind == "default":
        return theta, None
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(rope) - fields)
    if kind not in ("linear", "llama3", "yarn"):
        raise DstrainError(
            f"{source}: rope_parameters.rope_type={kind!r} is not supported; dstrain converts default, linear, "
            f"llama3 and yarn"
        )
    if unknown:
        raise DstrainError(f"{source}: rope_parameters.{unknown[0]} is not supported for rope_type {kind!r}")
    try:
        return theta, RopeScaling(type=kind, **{k: v for k, v in rope.items() if v is not None})
    except DstrainError as e:
        raise DstrainError(f"{source}: {e}") from None


def config_from_hf(hf: transformers.PretrainedConfig, family: str, source: str) -> GPTConfig:
    """Our GPTConfig of a transformers config of a llama-flavour family."""

    def require(ok: bool, key: str, value: object, fix: str) -> None:
        if not ok:
            raise DstrainError(f"{source}: {key}={value!r} is not supported; {fix}")

    require(hf.hidden_act == "silu", "hidden_act", hf.hidden_act, "dstrain's llama flavour uses silu")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        require(not getattr(hf, key, False), key, getattr(hf, key, False), "only false converts")
    theta, scaling = read_rope(hf.rope_parameters, source)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fixed = FIXED[family]
    moe, d_ff = None, hf.intermediate_size
    if family == "mixtral":
        moe = MoEConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            d_expert=hf.intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
        )
        d_ff = None
    elif family == "qwen3_moe":
        moe = MoEConfig(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            every=hf.decoder_sparse_step,
            d_expert=hf.moe_intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
            norm_topk_prob=hf.norm_topk_prob,
            dense_layers=list(hf.mlp_only_layers or []),
        )
    try:
        return GPTConfig(
            flavour="llama",
            family=None if family in ("llama", "mixtral") else family,
            vocab_size=hf.vocab_size,
            max_seq_len=hf.max_position_embeddings,
            n_layer=hf.num_hidden_layers,
            n_head=hf.num_attention_heads,
            n_kv_head=hf.num_key_value_heads or hf.num_attention_heads,
            d_model=hf.hidden_size,
            d_head=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
            d_ff=d_ff,
            tie_embeddings=hf.tie_word_embeddings,
            norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            init_std=hf.initializer_range,
            qkv_bias=fixed["qkv_bias"],
            qk_norm=fixed["qk_norm"],
            norm_placement=fixed["norm_placement"],
            sliding_window=getattr(hf, "sliding_window", None) if family in ("mistral", "mixtral") else None,
            moe=moe,
        )
    except DstrainError as e:
        raise DstrainError(f"{source}: {e}") from None


def hf_config(config: GPTConfig, bos_token_id: int | None, eos_token_id: int | None) -> transformers.PretrainedConfig:
    """The transformers config of config's family (check_exportable first)."""
    family = check_exportable(config, "model")
    architecture, config_class = CLASSES[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ff_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tied,
        rope_parameters=rope_parameters(config),
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        architectures=[architecture],
    )
    if family in ("llama", "qwen3", "olmo2", "qwen3_moe"):
        kwargs["attention_bias"] = False
    if family == "llama":
        kwargs["mlp_bias"] = False
    if family in SLIDING_KEY:
        kwargs["use_sliding_window"] = False
    if family in ("mistral", "mixtral"):
        kwargs["sliding_window"] = config.sliding_window
    moe = config.moe
    if family == "mixtral" and moe is not None:
        kwargs |= dict(intermediate_size=config.expert_dim, num_local_experts=moe.num_experts, router_jitter_noise=0.0)
        kwargs |= dict(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef)
    if family == "qwen3_moe" and moe is not None:
        kwargs |= dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob)
        kwargs |= dict(moe_intermediate_size=config.expert_dim, decoder_sparse_step=moe.every)
        kwargs |= dict(mlp_only_layers=list(moe.dense_layers), router_aux_loss_coef=moe.aux_loss_coef)
    return getattr(transformers, config_class)(**kwargs)


def block_names(config: GPTConfig, index: int) -> list[tuple[str, str]]:
    """(our name inside blocks.{index}, HF name inside model.layers.{index}) of every weight but the experts'."""
    post = config.norm_placement == "post"
    names = [
        ("attn_norm.weight", "post_attention_layernorm.weight" if post else "input_layernorm.weight"),
        ("mlp_norm.weight", "post_feedforward_layernorm.weight" if post else "post_attention_layernorm.weight"),
        *((f"self_attn.{p}_proj.weight",) * 2 for p in "qkvo"),
    ]
    if config.qkv_bias:
        names += [(f"self_attn.{p}_proj.bias",) * 2 for p in "qkv"]
    if config.qk_norm is not None:
        names += [("self_attn.q_norm.weight",) * 2, ("self_attn.k_norm.weight",) * 2]
    if not config.is_moe_block(index):
        names += [(f"mlp.{p}_proj.weight",) * 2 for p in ("gate", "up", "down")]
    return names
