"""The expert weights of an MoE block between our names and transformers' (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek,
GLM-4.5, Llama 4).

transformers stores each MoE layer's experts as two stacked tensors: experts.gate_up_proj (E, 2*ff, d) = [gate; up]
per expert, experts.down_proj (E, d, ff); the router is mlp.gate.weight (E, d). Our names are DeepSpeed MoE's
(global expert index e, as in an EP1 state dict and in DeepSpeed's per-expert checkpoint files). Routing itself is
dstrain.model.moe.route (softmax over all experts in fp32, top-k, renormalised unless moe.norm_topk_prob is false).
"""

from __future__ import annotations

import torch

from dstrain.model.config import GPTConfig
from dstrain.model.gpt import StateDict

MOE_PREFIX = "mlp.moe.deepspeed_moe"
ROUTER = f"{MOE_PREFIX}.gate.wg.weight"
ROUTER_BIAS = f"{MOE_PREFIX}.gate.wg.bias"  # GPT-OSS (model.moe.router_bias)
SCORE_BIAS = f"{MOE_PREFIX}.gate.e_score_correction_bias"  # DeepSeek-V3's balancing bias (model.moe.scoring sigmoid)


def expert_name(block: int, expert: int, proj: str, param: str = "weight") -> str:
    return f"blocks.{block}.{MOE_PREFIX}.experts.deepspeed_experts.{expert}.{proj}.{param}"


def experts_to_hf(config: GPTConfig, sd: StateDict, block: int, out: StateDict) -> None:
    """Adds block `block`'s router and stacked experts to the HF state dict `out`."""
    assert config.moe is not None
    layer, experts = f"model.layers.{block}", range(config.moe.num_experts)
    if config.family == "gpt_oss":
        return _gpt_oss_to_hf(config, sd, block, out)
    if config.family == "llama4":
        return _llama4_to_hf(config, sd, block, out)
    out[f"{layer}.mlp.gate.weight"] = sd[f"blocks.{block}.{ROUTER}"]
    out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[expert_name(block, e, "gate_proj")], sd[expert_name(block, e, "up_proj")]]) for e in experts]
    )
    out[f"{layer}.mlp.experts.down_proj"] = torch.stack([sd[expert_name(block, e, "down_proj")] for e in experts])
    for ours, hf in deepseek_names(config, block):
        out[hf] = sd[ours]


def experts_from_hf(config: GPTConfig, take, block: int, out: StateDict) -> None:
    """Adds block `block`'s router and each expert to our state dict `out`; `take`: hf.WeightTaker."""
    assert config.moe is not None
    layer, ff = f"model.layers.{block}", config.expert_dim
    if config.family == "gpt_oss":
        return _gpt_oss_from_hf(config, take, block, out)
    if config.family == "llama4":
        return _llama4_from_hf(config, take, block, out)
    out[f"blocks.{block}.{ROUTER}"] = take(f"{layer}.mlp.gate.weight")
    gate_up, down = take(f"{layer}.mlp.experts.gate_up_proj"), take(f"{layer}.mlp.experts.down_proj")
    for e in range(config.moe.num_experts):
        out[expert_name(block, e, "gate_proj")] = gate_up[e, :ff]
        out[expert_name(block, e, "up_proj")] = gate_up[e, ff:]
        out[expert_name(block, e, "down_proj")] = down[e]
    for ours, hf in deepseek_names(config, block):
        out[ours] = take(hf)


def deepseek_names(config: GPTConfig, block: int) -> list[tuple[str, str]]:
    """(our name, HF name) of DeepSeekMoE's shared experts and balancing bias in block `block`."""
    assert config.moe is not None
    names = []
    if config.moe.n_shared_experts:
        names += [(f"mlp.shared_experts.{p}_proj.weight",) * 2 for p in ("gate", "up", "down")]
    if config.moe.scoring == "sigmoid":
        names += [(SCORE_BIAS, "mlp.gate.e_score_correction_bias")]
    return [(f"blocks.{block}.{ours}", f"model.layers.{block}.{hf}") for ours, hf in names]


# GPT-OSS stores each expert transposed, (in, out), its gate and up interleaved along the output: gate_up_proj
# (E, d, 2*ff) with gate = [..., ::2], up = [..., 1::2], and biases beside; the router is mlp.router (weight, bias).


def _gpt_oss_to_hf(config: GPTConfig, sd: StateDict, block: int, out: StateDict) -> None:
    assert config.moe is not None
    layer, experts = f"model.layers.{block}", range(config.moe.num_experts)
    out[f"{layer}.mlp.router.weight"] = sd[f"blocks.{block}.{ROUTER}"]
    out[f"{layer}.mlp.router.bias"] = sd[f"blocks.{block}.{ROUTER_BIAS}"]

    def interleaved(e: int, param: str) -> torch.Tensor:
        gate, up = sd[expert_name(block, e, "gate_proj", param)], sd[expert_name(block, e, "up_proj", param)]
        return torch.stack([gate, up], dim=1).flatten(0, 1)  # rows g0, u0, g1, u1, ...

    out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([interleaved(e, "weight").t() for e in experts])
    out[f"{layer}.mlp.experts.gate_up_proj_bias"] = torch.stack([interleaved(e, "bias") for e in experts])
    out[f"{layer}.mlp.experts.down_proj"] = torch.stack([sd[expert_name(block, e, "down_proj")].t() for e in experts])
    out[f"{layer}.mlp.experts.down_proj_bias"] = torch.stack(
        [sd[expert_name(block, e, "down_proj", "bias")] for e in experts]
    )


def _gpt_oss_from_hf(config: GPTConfig, take, block: int, out: StateDict) -> None:
    assert config.moe is not None
    layer = f"model.layers.{block}"
    out[f"blocks.{block}.{ROUTER}"] = take(f"{layer}.mlp.router.weight")
    out[f"blocks.{block}.{ROUTER_BIAS}"] = take(f"{layer}.mlp.router.bias")
    gate_up, gate_up_bias = take(f"{layer}.mlp.experts.gate_up_proj"), take(f"{layer}.mlp.experts.gate_up_proj_bias")
    down, down_bias = take(f"{layer}.mlp.experts.down_proj"), take(f"{layer}.mlp.experts.down_proj_bias")
    for e in range(config.moe.num_experts):
        for proj, start in (("gate_proj", 0), ("up_proj", 1)):
            out[expert_name(block, e, proj)] = gate_up[e, :, start::2].t().contiguous()
            out[expert_name(block, e, proj, "bias")] = gate_up_bias[e, start::2].contiguous()
        out[expert_name(block, e, "down_proj")] = down[e].t().contiguous()
        out[expert_name(block, e, "down_proj", "bias")] = down_bias[e]


# Llama 4 stores its experts transposed too, (in, out) as GPT-OSS, but its gate and up side by side: gate_up_proj
# (E, d, 2*ff) = [gate | up] along the output, down_proj (E, ff, d); its router is feed_forward.router, its shared
# expert feed_forward.shared_expert (an MLP of the experts' width).


def _llama4_to_hf(config: GPTConfig, sd: StateDict, block: int, out: StateDict) -> None:
    assert config.moe is not None
    layer, experts = f"model.layers.{block}.feed_forward", range(config.moe.num_experts)
    out[f"{layer}.router.weight"] = sd[f"blocks.{block}.{ROUTER}"]
    out[f"{layer}.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[expert_name(block, e, "gate_proj")], sd[expert_name(block, e, "up_proj")]]).t() for e in experts]
    )
    out[f"{layer}.experts.down_proj"] = torch.stack([sd[expert_name(block, e, "down_proj")].t() for e in experts])
    for p in ("gate", "up", "down"):
        out[f"{layer}.shared_expert.{p}_proj.weight"] = sd[f"blocks.{block}.mlp.shared_experts.{p}_proj.weight"]


def _llama4_from_hf(config: GPTConfig, take, block: int, out: StateDict) -> None:
    assert config.moe is not None
    layer, ff = f"model.layers.{block}.feed_forward", config.expert_dim
    out[f"blocks.{block}.{ROUTER}"] = take(f"{layer}.router.weight")
    gate_up, down = take(f"{layer}.experts.gate_up_proj"), take(f"{layer}.experts.down_proj")
    for e in range(config.moe.num_experts):
        out[expert_name(block, e, "gate_proj")] = gate_up[e, :, :ff].t().contiguous()
        out[expert_name(block, e, "up_proj")] = gate_up[e, :, ff:].t().contiguous()
        out[expert_name(block, e, "down_proj")] = down[e].t().contiguous()
    for p in ("gate", "up", "down"):
        out[f"blocks.{block}.mlp.shared_experts.{p}_proj.weight"] = take(f"{layer}.shared_expert.{p}_proj.weight")


def local_experts(state: StateDict, config: GPTConfig, ep_size: int, ep_rank: int) -> StateDict:
    """A whole model's state dict cut to what GPT(config, ep_size, ep_rank) holds: its experts e = ep_rank * E/ep_size
    ..., named by their local index as DeepSpeed's MoE layer names them; the other experts left out."""
    assert config.moe is not None
    local, marker = config.moe.num_experts // ep_size, ".experts.deepspeed_experts."
    out = {}
    for name, tensor in state.items():
        if marker not in name:
            out[name] = tensor
            continue
        head, rest = name.split(marker)
        index, tail = rest.split(".", 1)
        if 0 <= int(index) - ep_rank * local < local:
            out[f"{head}{marker}{int(index) - ep_rank * local}.{tail}"] = tensor
    return out
