"""The mixture-of-experts MLP: Mixtral's, DeepSeek's and Llama 4's routers in DeepSpeed's MoE layer.

    MoEMLP.moe          deepspeed.moe.layer.MoE (the engine finds it: expert parameter groups, expert checkpoints)
      .deepspeed_moe.gate     Router (wg: the router matrix), replacing DeepSpeed's TopKGate
      .deepspeed_moe.experts  this rank's experts, each the flavour's own MLP (dstrain.model.gpt.MLP)

Why DeepSpeed's classic MoE layer with our own gate (and not AutoEP, nor a hand-written layer): its dispatch,
all-to-all and expert-data-parallel groups are DeepSpeed's, ZeRO-1/2 reduce expert gradients over the right group,
checkpoints store one file per expert, and the module is the same under EP1 and EP2 (a probe on 2 gloo ranks, then
tests/test_moe.py: same losses and gradient norms). AutoEP (DeepSpeed 0.19.8) would replace our block with its own
layer (fused expert tensors, its own router configured again in the ds_config: score_func, route_norm, top_k), so
the model, its names and its checkpoints would differ between EP1 and EP2; its one balancing option
(load_balance_coeff) is disabled in this build, and the issue's probe saw its preset path fail with the pinned
transformers. DeepSpeed's TopKGate is not Mixtral's router (its top-2 samples the second expert, its aux loss
counts first choices only), so the gate is ours: MOELayer takes any gate returning the sparse routes.

Expert parallelism is chosen by the ds_config, outside the model: GPT(config, ep_size, ep_rank) keeps experts
ep_rank * E/ep_size ... of each layer; every rank draws the initial weights of all experts in the same order, so
the weights of expert e are the same whatever the layout.

Activation checkpointing (checkpointed_moe_block): a checkpointed block's first forward runs without autograd, so
the router losses it leaves on the Router would carry no gradient. The block is therefore checkpointed as a function
returning (output, aux loss, z loss): the checkpoint's outputs join the graph, and the recompute in the backward
takes the losses' gradients back into the router. The recompute runs the Router again, so the Router keeps only its
last forward's losses and token counts, and the MoE meter (train/features/moe_metrics.py) adds them up once per
micro-batch,
outside the recomputed region.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.model.config import GPTConfig, MoEConfig


def route(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral's routing of (tokens, experts) logits: (probabilities in fp32, top-k weights, top-k experts).

    As transformers' MixtralTopKRouter: softmax over all experts in fp32, top_k largest, renormalised to sum to 1;
    normalize=False keeps the raw probabilities (Qwen3MoeTopKRouter with norm_topk_prob false).
    """
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights, experts


def deepseek_route(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeekMoE's routing of fp32 (tokens, experts) logits: (scores normalised to sum to 1, weights, experts).

    As transformers' DeepseekV3TopkRouter (scoring sigmoid: each expert's sigmoid, the balancing bias added for the
    choice only, a group scored by its two best experts, the chosen scores renormalised with norm_topk_prob) and
    DeepseekV2TopkRouter (scoring softmax: a group scored by its best expert, no renormalisation); both multiply the
    weights by routed_scaling_factor. Group-limited: only experts of the topk_group best of n_group groups are chosen.
    """
    sigmoid = moe.scoring == "sigmoid"
    scores = logits.sigmoid() if sigmoid else F.softmax(logits, dim=-1)
    choice = scores + bias if bias is not None else scores
    if moe.n_group > 1:
        grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.max(dim=-1).values
        chosen = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        choice = choice.masked_fill(~keep, float("-inf") if sigmoid else 0.0)
    experts = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if sigmoid and moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    probs = scores / scores.sum(dim=-1, keepdim=True) if sigmoid else scores
    return probs, weights * moe.routed_scaling_factor, experts


def llama4_route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama 4's top-1 routing of (tokens, experts) logits: (softmax probabilities in fp32 for the balancing loss,
    the chosen expert's sigmoid score in fp32, the chosen expert), as transformers' Llama4Router: top-1 of the raw
    logits, sigmoid in fp32. The score scales the expert's input (MoEMLP.forward), not its output."""
    top, experts = torch.topk(logits, 1, dim=-1)
    return F.softmax(logits.float(), dim=-1), top.float().sigmoid(), experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """HF Mixtral's load_balancing_loss_func for one layer: E * sum_e f_e * P_e, with f_e the share of tokens routed
    to expert e (each of its top_k choices counts; sums to top_k) and P_e the mean router probability of e.
    Equals top_k when routing is uniform."""
    num_experts = probs.shape[-1]
    chosen = F.one_hot(experts, num_experts).float()  # (tokens, top_k, E)
    tokens_per_expert = chosen.mean(dim=0)  # (top_k, E)
    return (tokens_per_expert * probs.mean(dim=0)).sum() * num_experts


def sequence_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (§2.1.2, eq. 17-20) without its alpha, averaged over the packed
    samples: per sample of seq_len tokens sum_i f_i * P_i, with f_i = E/(top_k * seq_len) * the sample's choices of
    expert i and P_i the sample's mean normalised score of i. probs: (samples * seq_len, E), row-major by sample.
    Equals 1 when routing is balanced. As DeepSeek-V2's published MoEGate with seq_aux."""
    num_experts, top_k = probs.shape[-1], experts.shape[-1]
    chosen = F.one_hot(experts, num_experts).float().sum(dim=1).view(-1, seq_len, num_experts)
    f = chosen.sum(dim=1) * (num_experts / (top_k * seq_len))  # (samples, E)
    return (f * probs.view(-1, seq_len, num_experts).mean(dim=1)).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Router(nn.Module):
    """A gate for DeepSpeed's MOELayer with Mixtral's routing, dropless.

    Returns the sparse routes MOELayer dispatches; keeps this forward's losses (aux_loss, z_loss, differentiable)
    and token counts per expert (`counts`, None after an eval forward), which the MoE meter reads once per
    micro-batch: a recompute in the backward overwrites them with the same values and counts nothing twice.
    """

    e_score_correction_bias: torch.Tensor | None  # a buffer with sigmoid scoring (see __init__), else None

    def __init__(self, config: GPTConfig, wg: nn.Module) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe = config.moe
        self.top_k, self.num_experts = config.moe.top_k, config.moe.num_experts
        self.normalize = config.moe.norm_topk_prob
        self.wg = wg  # d_model -> num_experts logits, without bias
        # DeepSeek's router (deepseek_route) for everything Mixtral's does not compute
        moe = config.moe
        self.deepseek = moe.scoring == "sigmoid" or moe.n_group > 1 or moe.routed_scaling_factor != 1.0
        # The loss-free balancing bias of sigmoid scoring (train/features/balancing.py moves it), fp32 as in
        # transformers.
        bias = torch.zeros(self.num_experts, dtype=torch.float32) if moe.scoring == "sigmoid" else None
        self.register_buffer("e_score_correction_bias", bias)
        self.ep_group = None  # set by DeepSpeed (MOELayer._set_ep_group) once the engine made the groups
        self.aux_loss = self.z_loss = torch.zeros(())
        # Tokens per expert of the last training forward; not a buffer, which a bf16 engine would round.
        self.counts: torch.Tensor | None = None
        self.seq_len: int | None = None  # tokens per packed sample of the coming forward (set by MoEMLP)
        self.planned: tuple[torch.Tensor, ...] | None = None  # Llama 4's routes of the coming forward (scale_input)

    def routes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, probabilities, weights, experts) of the tokens x: (tokens, d_model)."""
        if self.moe.router_fp32:  # DeepSeek's router: F.linear in fp32
            wg: nn.Linear = self.wg  # type: ignore[assignment]  # the Linear Block gives
            logits = F.linear(x.float(), wg.weight.float(), None if wg.bias is None else wg.bias.float())
        else:
            logits = self.wg(x)  # in the model's dtype, as HF's router
        if self.moe.input_scaling:
            return logits, *llama4_route(logits)
        if self.deepseek:
            bias = self.e_score_correction_bias
            return logits, *deepseek_route(logits.float(), self.moe, None if bias is None else bias.float())
        return logits, *route(logits, self.top_k, self.normalize)

    def scale_input(self, x: torch.Tensor) -> torch.Tensor:
        """Llama 4: x (tokens, d_model) scaled by each token's chosen expert's score; the routes kept for the
        forward that MOELayer runs next on the scaled tokens (they are the unscaled tokens' routes)."""
        self.planned = self.routes(x)
        return x * self.planned[2].to(x.dtype)

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token=None, sparse_routes: bool = True, use_tutel: bool = False):
        """x: (tokens, d_model) -> (aux loss, capacity, E, experts, slots, weights, counts) as MOELayer reads them:
        experts, slots (position in the expert's buffer) and weights are (top_k, tokens)."""
        if used_token is not None or not sparse_routes or use_tutel:
            raise NotImplementedError("dstrain's Router serves MOELayer's sparse routes only")
        if self.planned is not None:  # Llama 4: routed before the input was scaled; each output taken whole
            logits, probs, weights, experts = self.planned
            weights, self.planned = torch.ones_like(weights), None
        else:
            logits, probs, weights, experts = self.routes(x)
        if self.moe.aux_loss_kind == "sequence":
            self.aux_loss = sequence_balancing_loss(probs, experts, self.seq_len or x.shape[0])
        else:
            self.aux_loss = load_balancing_loss(probs, experts)
        self.z_loss = z_loss(logits)
        routes = experts.t().reshape(-1)  # first choices of all tokens, then second choices, ...
        one_hot = F.one_hot(routes, self.num_experts)
        slots = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1).view(self.top_k, -1)
        counts = one_hot.sum(dim=0)
        self.counts = counts.detach().to(torch.float64) if self.training else None
        # Dropless: the buffer holds the busiest expert's tokens on any rank of the expert-parallel group.
        capacity = counts.max().detach()
        if self.ep_group is not None and torch.distributed.get_world_size(self.ep_group) > 1:
            torch.distributed.all_reduce(capacity, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
        return (
            self.aux_loss,
            capacity,
            self.num_experts,
            experts.t().to(torch.int32),
            slots.to(torch.int32),
            weights.t(),
            counts.detach(),
        )


class MoEMLP(nn.Module):
    """The MLP of an MoE block: num_experts experts of the flavour's MLP, top_k of them per token."""

    def __init__(
        self,
        config: GPTConfig,
        wg: nn.Module,
        drawn: list[nn.Module],
        ep_size: int = 1,
        ep_rank: int = 0,
        shared: nn.Module | None = None,
    ) -> None:
        """``wg``: the router's projection; ``drawn``: every expert (the flavour's MLP), drawn in order after it,
        so that expert e starts the same under any expert-parallel layout; this rank keeps its share. ``shared``:
        DeepSeekMoE's shared experts (one MLP every token runs through, beside the routed ones), or None."""
        super().__init__()
        from deepspeed.moe.layer import MoE

        assert config.moe is not None
        num_experts = config.moe.num_experts
        router = Router(config, wg)
        local = num_experts // ep_size
        # DeepSpeed copies the template once per local expert (and flags the copies as expert parameters);
        # each copy then takes the weights drawn for its global index. drop_tokens=False: capacity is ours.
        self.moe = MoE(config.d_model, drawn[0], num_experts, ep_size, k=config.moe.top_k, drop_tokens=False)
        self.moe.deepspeed_moe.gate = router
        experts = self.moe.deepspeed_moe.experts.deepspeed_experts
        for index, expert in enumerate(experts):
            expert.load_state_dict(drawn[ep_rank * local + index].state_dict())
        self.shared_experts = shared

    @property
    def router(self) -> Router:
        return self.moe.deepspeed_moe.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router.seq_len = x.shape[-2] if x.dim() > 2 else None  # the samples of (batch, seq, d_model)
        if self.router.moe.input_scaling:
            routed = self.moe(self.router.scale_input(x.reshape(-1, x.shape[-1])).view_as(x))[0]
        else:
            routed = self.moe(x)[0]
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


def checkpointed_moe_block(checkpoint_fn, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """block(*args) through ``checkpoint_fn`` (deepspeed.checkpointing.checkpoint) with its router's losses among the
    checkpoint's outputs (module docstring): what the Router holds afterwards is part of the graph, and the loss
    built on it reaches the router's weights through the recompute."""
    mlp = block.mlp
    assert isinstance(mlp, MoEMLP)
    router = mlp.router

    def block_and_router_losses(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return block(*inputs), router.aux_loss, router.z_loss

    out, router.aux_loss, router.z_loss = checkpoint_fn(block_and_router_losses, *args)
    return out


def moe_routers(model: nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def router_losses(model: nn.Module, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted sum to add to the LM loss, mean load-balancing loss, mean z-loss) of the last forward."""
    routers = moe_routers(model)
    aux = torch.stack([r.aux_loss for r in routers]).mean()
    z = torch.stack([r.z_loss for r in routers]).mean()
    assert config.moe is not None
    return config.moe.aux_loss_coef * aux + config.moe.z_loss_coef * z, aux, z
