"""Conversion between our llama-flavour MoE GPT and transformers' MixtralForCausalLM.

Mixtral is llama attention with a mixture of experts in every block, routed exactly as dstrain.model.moe.route
(softmax over all experts in fp32, top-k, renormalised). transformers stores each layer's experts as two stacked
tensors: experts.gate_up_proj (E, 2*ff, d) = [gate; up] per expert, experts.down_proj (E, d, ff); the router is
mlp.gate.weight (E, d). Our names are DeepSpeed MoE's (global expert index e, as in an EP1 state dict and in
DeepSpeed's per-expert checkpoint files).
"""

from __future__ import annotations

import torch
import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, MoEConfig
from dstrain.model.gpt import StateDict

MOE_PREFIX = "mlp.moe.deepspeed_moe"
ROUTER = f"{MOE_PREFIX}.gate.wg.weight"
# (our name inside blocks.{i}, HF name inside model.layers.{i}) of everything but the MoE MLP
ATTENTION_NAMES = [
    ("attn_norm.weight", "input_layernorm.weight"),
    *((f"self_attn.{p}_proj.weight",) * 2 for p in "qkvo"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
]


def expert_name(block: int, expert: int, proj: str) -> str:
    return f"blocks.{block}.{MOE_PREFIX}.experts.deepspeed_experts.{expert}.{proj}.weight"


def check_exportable(config: GPTConfig, source: str) -> None:
    """Mixtral has a llama-flavour MoE in every block: other shapes have no lossless HF counterpart."""
    if config.moe is None:
        raise AssertionError("not an MoE config")
    if config.flavour != "llama" or config.moe.every != 1:
        raise DstrainError(
            f"{source}: only model.flavour llama with model.moe.every 1 exports to MixtralForCausalLM "
            f"(got flavour {config.flavour!r}, every {config.moe.every})"
        )


def to_mixtral(
    config: GPTConfig, sd: StateDict, bos_token_id: int | None, eos_token_id: int | None
) -> tuple[transformers.PretrainedConfig, StateDict]:
    check_exportable(config, "model")
    assert config.moe is not None
    hf_config = transformers.MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.expert_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tied,
        sliding_window=None,
        num_experts_per_tok=config.moe.top_k,
        num_local_experts=config.moe.num_experts,
        router_aux_loss_coef=config.moe.aux_loss_coef,
        router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        architectures=["MixtralForCausalLM"],
    )
    out = {"model.embed_tokens.weight": sd["embed.tok.weight"]}
    for i in range(config.n_layer):
        layer = f"model.layers.{i}"
        for ours, hf in ATTENTION_NAMES:
            out[f"{layer}.{hf}"] = sd[f"blocks.{i}.{ours}"]
        out[f"{layer}.mlp.gate.weight"] = sd[f"blocks.{i}.{ROUTER}"]
        experts = range(config.moe.num_experts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[expert_name(i, e, "gate_proj")], sd[expert_name(i, e, "up_proj")]]) for e in experts]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([sd[expert_name(i, e, "down_proj")] for e in experts])
    out["model.norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if config.tied else sd["lm_head.weight"]
    return hf_config, out


def mixtral_config_from_hf(hf: transformers.MixtralConfig, llama: GPTConfig, source: str) -> GPTConfig:
    """`llama`: the attention part, read by hf._llama_config_from_hf (Mixtral shares LlamaConfig's fields)."""
    if hf.sliding_window is not None:
        raise DstrainError(f"{source}: sliding_window={hf.sliding_window} is not supported; only null converts")
    moe = MoEConfig(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        every=1,
        d_expert=hf.intermediate_size,
        aux_loss_coef=hf.router_aux_loss_coef,
    )
    return GPTConfig(**{**llama.__dict__, "d_ff": None, "moe": moe})


def from_mixtral(config: GPTConfig, take) -> StateDict:
    """`take`: hf._WeightTaker over the Mixtral state dict."""
    assert config.moe is not None
    out = {"embed.tok.weight": take("model.embed_tokens.weight")}
    ff = config.expert_dim
    for i in range(config.n_layer):
        layer = f"model.layers.{i}"
        for ours, hf in ATTENTION_NAMES:
            out[f"blocks.{i}.{ours}"] = take(f"{layer}.{hf}")
        out[f"blocks.{i}.{ROUTER}"] = take(f"{layer}.mlp.gate.weight")
        gate_up, down = take(f"{layer}.mlp.experts.gate_up_proj"), take(f"{layer}.mlp.experts.down_proj")
        for e in range(config.moe.num_experts):
            out[expert_name(i, e, "gate_proj")] = gate_up[e, :ff]
            out[expert_name(i, e, "up_proj")] = gate_up[e, ff:]
            out[expert_name(i, e, "down_proj")] = down[e]
    out["norm.weight"] = take("model.norm.weight")
    out["lm_head.weight"] = out["embed.tok.weight"] if config.tied else take("lm_head.weight")
    take.discard("lm_head.weight")
    take.check_all_used()
    return out
