"""The published llama-flavour families: the transformers class each one is, the model.* features its class has
fixed, and the names of its weights inside one decoder layer. dstrain.model.hf.convert converts weights with these
tables,
dstrain.model.hf.family_configs the configs (docs/published-models.md has the table for users).

| family    | transformers class   | features (model.* fields)                                                     |
|-----------|----------------------|-------------------------------------------------------------------------------|
| llama     | LlamaForCausalLM     | rope_scaling (Llama 3.x: llama3)                                              |
| mistral   | MistralForCausalLM   | sliding_window (every block local)                                            |
| qwen2     | Qwen2ForCausalLM     | qkv_bias (Qwen2 and Qwen2.5); layer_types with use_sliding_window (also Qwen3)|
| qwen3     | Qwen3ForCausalLM     | qk_norm head, d_head                                                          |
| olmo2     | Olmo2ForCausalLM     | qk_norm projection, norm_placement post                                       |
| mixtral   | MixtralForCausalLM   | moe (every 1), sliding_window                                                 |
| qwen3_moe | Qwen3MoeForCausalLM  | qk_norm head, d_head, moe: norm_topk_prob, every, dense_layers                |
| smollm3   | SmolLM3ForCausalLM   | nope_layers (every 4th block without RoPE)                                    |
| phi3      | Phi3ForCausalLM      | partial_rotary_factor, sliding_window; qkv_proj, gate_up_proj fused in HF     |
| gemma3    | Gemma3ForCausalLM    | layer_types (5 local : 1 global), sliding_window, rope_local_theta,           |
|           |                      | norm_placement sandwich, norm_unit_offset, scale_embeddings, qk_norm head,    |
|           |                      | mlp_activation gelu_tanh, query_pre_attn_scalar, d_head                       |
| gemma2    | Gemma2ForCausalLM    | as gemma3 without qk_norm and rope_local_theta, plus attn_softcap and         |
|           |                      | logit_softcap (soft-capped scores and logits); layer_types alternating        |
| gpt_oss   | GptOssForCausalLM    | attention_sinks, layer_types (alternating 128-token windows), qkv_bias,       |
|           |                      | o_bias, moe: router_bias, expert_bias, swiglu_limit, swiglu_alpha (top-4)     |
| olmo3     | Olmo3ForCausalLM     | as olmo2, plus layer_types (3 local : 1 global), sliding_window and           |
|           |                      | rope_local_theta (the local blocks' RoPE unscaled, the same base)             |
| llama4    | Llama4ForCausalLM    | layer_types (chunked_attention on the RoPE blocks), attention_chunk,          |
|           |                      | nope_layers (every 4th), qk_norm l2, attn_temperature_floor/_scale, d_head;   |
|           |                      | RoPE on interleaved pairs in HF (q/k rows reordered); dense blocks only       |
| deepseek_v3 | DeepseekV3ForCausalLM | mla (latent attention), rope_scaling yarn with mscale; moe: scoring sigmoid,|
|           |                      | n_group, topk_group, routed_scaling_factor, n_shared_experts, dense_layers    |
|           |                      | (first_k_dense_replace), router_fp32 (also Moonlight, Kimi K2)                |
| deepseek_v2 | DeepseekV2ForCausalLM | mla; moe: scoring softmax, unnormalised, groups by topk_method, shared     |
| glm4_moe  | Glm4MoeForCausalLM   | DeepSeek-V3's moe with GQA: qkv_bias (attention_bias), qk_norm head           |
|           |                      | (use_qk_norm), partial_rotary_factor (GLM-4.5, 4.6)                           |

Qwen3-MoE's decoder_sparse_step is moe.every, its mlp_only_layers moe.dense_layers, moe_intermediate_size d_expert.
"""

from __future__ import annotations

from typing import Any

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig

# family -> (transformers model class, its config class)
CLASSES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig"),
    # --- issue 50's families ---
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config"),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
}
ARCHITECTURE_FAMILY = {architecture: family for family, (architecture, _) in CLASSES.items()}
_LLAMA: dict[str, Any] = {"qkv_bias": False, "qk_norm": None, "norm_placement": "pre", "moe": False, "mla": False}
_GEMMA = _LLAMA | {"norm_placement": "sandwich", "norm_unit_offset": True, "scale_embeddings": True}
_GEMMA |= {"mlp_activation": "gelu_tanh"}
# The model.* features each family's class has fixed (an export to it must match them; a feature its class cannot
# express at all is caught by the round trip in family_configs.hf_config).
FIXED: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA | {"qkv_bias": True},
    "qwen3": _LLAMA | {"qk_norm": "head"},
    "olmo2": _LLAMA | {"qk_norm": "projection", "norm_placement": "post"},
    "mixtral": _LLAMA | {"moe": True},
    "qwen3_moe": _LLAMA | {"qk_norm": "head", "moe": True},
    "smollm3": _LLAMA,
    "phi3": _LLAMA,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA | {"qk_norm": "head"},
    "gpt_oss": _LLAMA | {"qkv_bias": True, "o_bias": True, "attention_sinks": True, "moe": True},
    # --- issue 50's families ---
    "olmo3": _LLAMA | {"qk_norm": "projection", "norm_placement": "post"},
    "llama4": {k: v for k, v in _LLAMA.items() if k not in ("qk_norm", "moe")},  # qk_norm l2 or none; moe_layers
    "deepseek_v3": _LLAMA | {"moe": True, "mla": True},
    "deepseek_v2": _LLAMA | {"moe": True, "mla": True},
    "glm4_moe": {"norm_placement": "pre", "moe": True, "mla": False},  # q/k/v biases and q/k norms optional
}
FFN_PREFIX = {"llama4": "feed_forward"}  # HF's name of a decoder layer's MLP where it is not "mlp"
INTERLEAVED_ROPE = {"llama4"}  # HF rotates pairs (2i, 2i+1) of each head: q/k rows reordered (dstrain.model.hf.convert)
DEEPSEEK = {"deepseek_v3", "deepseek_v2"}  # latent attention; its weights: mla_names below
DEEPSEEK_MOE = DEEPSEEK | {"glm4_moe"}  # DeepSeekMoE, whose classes record no auxiliary-loss weight
WINDOW_EVERY_BLOCK = {"mistral", "mixtral", "phi3"}  # one sliding_window for every block (no layer_types in HF)
WINDOW_PER_BLOCK = {"gemma2", "gemma3", "gpt_oss", "olmo3"}  # HF's layer_types and sliding_window
LOCAL_ROPE = {"gemma3", "olmo3"}  # one rope_parameters per layer type: the local blocks' unscaled (rope_local_theta)
SLIDING_KEY = {"qwen2", "qwen3", "qwen3_moe", "smollm3"}  # config has use_sliding_window (Qwen3-MoE: only false)
WINDOW_WHEN_ENABLED = {"qwen2", "qwen3", "smollm3"}  # use_sliding_window true: HF's layer_types and sliding_window
# HF name of a fused weight in a decoder layer -> our names, concatenated in this order along the output dimension.
FUSED: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {
        "self_attn.qkv_proj.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    }
}


def check_exportable(config: GPTConfig, source: str) -> str:
    """The family's name, once config's features are what its transformers class computes."""
    family = config.resolved_family
    for key, value in FIXED[family].items():
        ours = (getattr(config, key) is not None) if key in ("moe", "mla") else getattr(config, key)
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


def block_names(config: GPTConfig, index: int) -> list[tuple[str, str]]:
    """(our name inside blocks.{index}, HF name inside model.layers.{index}) of every weight but the experts'; a
    weight HF fuses (FUSED) is listed under its own name, hf.py joins and splits it."""
    post = {
        "pre": ("input_layernorm", "post_attention_layernorm"),
        "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
        "sandwich": ("input_layernorm", "pre_feedforward_layernorm"),
    }[config.norm_placement]
    attention = [(f"self_attn.{p}_proj.weight",) * 2 for p in "qkvo"]
    if config.mla is not None:
        attention = [(f"self_attn.{name}.weight",) * 2 for name in mla_names(config)]
    names = [("attn_norm.weight", f"{post[0]}.weight"), ("mlp_norm.weight", f"{post[1]}.weight"), *attention]
    if config.norm_placement == "sandwich":
        names += [("attn_post_norm.weight", "post_attention_layernorm.weight")]
        names += [("mlp_post_norm.weight", "post_feedforward_layernorm.weight")]
    if config.qkv_bias:
        names += [(f"self_attn.{p}_proj.bias",) * 2 for p in "qkv"]
    if config.o_bias:
        names += [("self_attn.o_proj.bias",) * 2]
    if config.qk_norm in ("head", "projection"):
        names += [("self_attn.q_norm.weight",) * 2, ("self_attn.k_norm.weight",) * 2]
    if config.attention_sinks:
        names += [("self_attn.sinks",) * 2]
    if not config.is_moe_block(index):
        ffn = FFN_PREFIX.get(config.resolved_family, "mlp")
        names += [(f"mlp.{p}_proj.weight", f"{ffn}.{p}_proj.weight") for p in ("gate", "up", "down")]
    return names


# --- DeepSeek's latent attention (model/mla.py): its weights have transformers' names ---


def mla_names(config: GPTConfig) -> list[str]:
    """The modules of one latent attention whose weights convert one to one."""
    assert config.mla is not None
    query = ["q_proj"] if config.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    return [*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
