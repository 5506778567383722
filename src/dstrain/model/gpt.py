"""A decoder-only GPT in two flavours, `gpt2` and `llama`, in one readable file.

gpt2:  learned absolute positions, LayerNorm with bias, GELU (tanh), 4*d MLP, biases, tied embeddings.
llama: RoPE (HF rotate_half convention), RMSNorm, SwiGLU MLP, no biases, optional GQA, untied embeddings.

The published llama-like families are features of the llama flavour, each a model.* field (model/config.py):
RoPE scaling (rope_scaling, model/rope.py), q/k/v biases (qkv_bias), q/k RMSNorm per head or over the projection
(qk_norm), a head width apart from d_model/n_head (d_head), norms after attention and MLP (norm_placement), and
MoE routing options (moe.norm_topk_prob, moe.dense_layers). Per block: local attention within a window
(layer_types, sliding_window), no RoPE (nope_layers), sinks (attention_sinks). Gemma's conventions (norm_unit_offset,
scale_embeddings, mlp_activation gelu_tanh, query_pre_attn_scalar, rope_local_theta, Gemma 2's attn_softcap and
logit_softcap), Phi-3's partial rotary (partial_rotary_factor), Llama 4's chunks (attention_chunk), weightless q/k
norm after RoPE (qk_norm l2) and temperature tuning (attn_temperature_floor), and DeepSeek's latent attention in
place of q/k/v heads (model.mla: model/mla.py). model/hf/families.py says which family uses which;
docs/published-models.md explains them.

Module tree (shared by both flavours, so a pipeline engine can cut the same blocks into stages):

    GPT.embed   Embedding(tok[, pos])
    GPT.blocks  ModuleList[Block(attn_norm, self_attn(q_proj, k_proj, v_proj, o_proj[, q_norm, k_norm]), mlp_norm,
                                 mlp([gate_proj,] up_proj, down_proj))]
    GPT.norm    final norm
    GPT.lm_head nn.Linear, weight tied to embed.tok.weight when tied

The `self_attn.*_proj` / `mlp.*_proj` names are what DeepSpeed AutoTP's llama preset matches.

Initialisation happens inside the constructor of the module that owns each parameter (`Linear`,
`EmbeddingTable`, and torch's own norms). Under `deepspeed.zero.Init` every submodule's parameters
are partitioned as soon as its `__init__` returns, so a parent-level `apply(init_fn)` would only see
empty shards and silently leave the weights at their constructor values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.model.chunked_loss import chunked_loss_sum, soft_cap
from dstrain.model.config import GPTConfig
from dstrain.model.doc_attention import doc_attention, temperature_tuned
from dstrain.model.kv_cache import KVCache
from dstrain.model.layers import Linear, apply_rope, normal_init
from dstrain.model.mla import LatentAttention, softmax_scale
from dstrain.model.moe import MoEMLP, checkpointed_moe_block
from dstrain.model.rope import rope_cos_sin

StateDict = dict[str, torch.Tensor]  # a model's weights by parameter name

# --- leaf modules that initialise their own parameters (see the module docstring) ---


class Head(Linear):
    """lm_head: d_model -> vocab_size without bias, its logits soft-capped where model.logit_softcap says, so that
    every caller (GPT.forward, the tiled loss, the pipeline's last stage) gets the same logits."""

    def __init__(self, config: GPTConfig, std: float | None) -> None:
        super().__init__(config.d_model, config.vocab_size, bias=False, std=std)
        self.cap = config.logit_softcap

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
        """The logits; given labels, the sum of their token losses instead, ``chunks`` chunks of the tokens at a time
        (model/chunked_loss.py), inside this forward so that ZeRO-3 gathers the weight around it."""
        if labels is not None:
            return chunked_loss_sum(x, self.weight, labels, chunks, self.cap)
        return soft_cap(super().forward(x), self.cap)


class EmbeddingTable(nn.Embedding):
    """nn.Embedding drawing weight ~ normal(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        normal_init(self.weight, self.std)


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised in fp32, scaled by (1 + weight), the weight starting at 0 (model.norm_unit_offset);
    transformers' Gemma3RMSNorm, which torch's RMSNorm (scaled by weight) is not."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """The flavour's norm over `width` features (default d_model)."""
    # torch's norms set weight=1 (and bias=0) in their own constructors; RMSNorm is one fused kernel.
    if config.flavour == "gpt2":
        return nn.LayerNorm(width or config.d_model, eps=config.norm_eps)
    if config.norm_unit_offset:
        return UnitOffsetRMSNorm(width or config.d_model, config.norm_eps)
    return nn.RMSNorm(width or config.d_model, eps=config.norm_eps)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its RMS along the last dimension, in fp32, no weight (transformers' Llama4TextL2Norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


# --- the transformer ---


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal and, with doc masking, within each document; on a local block within its
    window (model.layer_types, sliding_window), with sinks given (model.attention_sinks) one more logit per head.

    q, k, v: (B, L, heads, head_dim), the result too. A module of its own, without parameters, so that sequence
    parallelism can wrap it from outside (dstrain.train.engine.sequence) without changing any parameter name.
    """

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.config = config
        self.window, self.chunk = config.window(index), config.chunk(index)
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        if config.mla is not None:  # DeepSeek: qk_head_dim**-0.5, with YaRN's mscale correction (model/mla.py)
            self.scale = softmax_scale(config)
        self.softcap = config.attn_softcap
        # Llama 4: the blocks without RoPE sharpen with position; counted over the whole (gathered) sequence
        self.temperature = None if config.uses_rope(index) else config.attn_temperature_floor

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None, sinks=None
    ) -> torch.Tensor:
        documents = position_ids if self.config.doc_masking else None
        if self.temperature is not None:
            q = temperature_tuned(q, documents, self.temperature, self.config.attn_temperature_scale)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = doc_attention(q, k, v, documents, self.window, sinks, self.scale, self.softcap, self.chunk)
        return y.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.config = config
        self.index, self.rope, self.local = index, config.uses_rope(index), config.window(index) is not None
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        bias = config.flavour == "gpt2"
        qkv_bias = bias or config.qkv_bias
        d, std = config.d_model, config.init_std
        q_width, kv_width = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.q_proj = Linear(d, q_width, qkv_bias, std)
        self.k_proj = Linear(d, kv_width, qkv_bias, std)
        self.v_proj = Linear(d, kv_width, qkv_bias, std)
        self.o_proj = Linear(q_width, d, bias or config.o_bias, std / math.sqrt(2 * config.n_layer))
        # Per head: one weight every head uses, whole on each TP/SP rank (under TP its gradient is summed over the
        # group: train/engine/build.py). Over the projection (OLMo 2): it spans every head, so TP is refused.
        if config.qk_norm in ("head", "projection"):
            per_head = config.qk_norm == "head"
            self.q_norm = make_norm(config, self.head_dim if per_head else q_width)
            self.k_norm = make_norm(config, self.head_dim if per_head else kv_width)
        self.core = CoreAttention(config, index)
        if config.attention_sinks:  # GPT-OSS's sinks: one logit per query head, initialised as transformers does
            self.sinks = nn.Parameter(torch.empty(self.n_head))
            normal_init(self.sinks, config.init_std)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:
        """cache: decoding (model/kv_cache.py): this forward's keys and values join the cached ones."""
        batch, length, _ = x.shape
        # Head counts come from the shapes (-1): under tensor parallelism each rank holds a slice of the heads.
        q, k = self.q_proj(x), self.k_proj(x)
        if self.config.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(batch, length, -1, self.head_dim), k.view(batch, length, -1, self.head_dim)
        if self.config.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            positions = position_ids if position_ids is not None else torch.arange(length, device=x.device)[None]
            cos, sin = rope_cos_sin(positions, self.config, q.dtype, self.local)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.config.qk_norm == "l2":  # Llama 4: per head, no weight, after RoPE
                q, k = unit_rms(q, self.config.norm_eps), unit_rms(k, self.config.norm_eps)
        if cache is not None:
            y = cache.attend(self.index, q, k, v, self.core.scale).transpose(1, 2)
            return self.o_proj(y.reshape(batch, length, -1))
        # (B, L, heads, head_dim) in and out of the core: the layout sequence parallelism exchanges.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Sinks only where the model has them: Ulysses' wrapper passes the core no more than position_ids.
        sinks = (self.sinks,) if self.config.attention_sinks else ()
        y = self.core(q, k, v, position_ids, *sinks)
        return self.o_proj(y.reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, width: int | None = None, expert: bool = False) -> None:
        """expert: one expert of an MoE layer, which model.moe may give biases and GPT-OSS's clamped SwiGLU."""
        super().__init__()
        d, ff, std = config.d_model, width or config.ff_dim, config.init_std
        self.swiglu = config.flavour == "llama"  # gated: SwiGLU, or GeGLU with mlp_activation gelu_tanh (Gemma)
        self.gelu_gate = config.mlp_activation == "gelu_tanh"
        moe = config.moe if expert else None
        self.limit, self.alpha = (moe.swiglu_limit, moe.swiglu_alpha) if moe is not None else (None, 1.0)
        bias = not self.swiglu or (moe is not None and moe.expert_bias)
        if self.swiglu:
            self.gate_proj = Linear(d, ff, bias, std)
        self.up_proj = Linear(d, ff, bias, std)
        self.down_proj = Linear(ff, d, bias, std / math.sqrt(2 * config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:  # GPT-OSS: transformers' GptOssExperts._apply_gate
            gate, up = self.gate_proj(x).clamp(max=self.limit), self.up_proj(x).clamp(-self.limit, self.limit)
            return self.down_proj(gate * torch.sigmoid(gate * self.alpha) * (up + 1))
        if self.swiglu:
            gate = self.gate_proj(x)
            gate = F.gelu(gate, approximate="tanh") if self.gelu_gate else F.silu(gate)
            return self.down_proj(gate * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); with norm_placement post (OLMo 2)
    x + norm(attn(x)), then x + norm(mlp(x)); sandwich (Gemma 3) x + norm(attn(norm(x))), x + norm(mlp(norm(x))).
    The MLP is a mixture of experts (dstrain.model.moe) in the blocks model.moe names, holding this rank's share of
    the experts."""

    def __init__(self, config: GPTConfig, index: int = 0, ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.self_attn: nn.Module
        if config.mla is not None:  # DeepSeek's latent attention (model/mla.py) around the same core
            self.self_attn = LatentAttention(config, CoreAttention(config, index))
        else:
            self.self_attn = Attention(config, index)
        self.mlp_norm = make_norm(config)
        self.mlp: nn.Module
        if config.moe is not None and config.is_moe_block(index):  # the router drawn first, then each expert
            wg = Linear(config.d_model, config.moe.num_experts, bias=config.moe.router_bias, std=config.init_std)
            experts: list[nn.Module] = [MLP(config, config.expert_dim, True) for _ in range(config.moe.num_experts)]
            shared = config.moe.n_shared_experts  # DeepSeekMoE: one MLP of all shared experts, beside the routed
            shared_mlp = MLP(config, config.expert_dim * shared) if shared else None
            self.mlp = MoEMLP(config, wg, experts, ep_size, ep_rank, shared_mlp)
        else:
            self.mlp = MLP(config)
        self.placement = config.norm_placement
        if self.placement == "sandwich":  # the norms after attention and MLP, beside the ones before (Gemma 3)
            self.attn_post_norm, self.mlp_post_norm = make_norm(config), make_norm(config)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if self.placement == "sandwich":
            x = x + self.attn_post_norm(self.attend(self.attn_norm(x), position_ids, cache))
            return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))
        if self.placement == "post":
            x = x + self.attn_norm(self.attend(x, position_ids, cache))
            return x + self.mlp_norm(self.mlp(x))
        x = x + self.attend(self.attn_norm(x), position_ids, cache)
        return x + self.mlp(self.mlp_norm(x))

    def attend(self, x: torch.Tensor, position_ids: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        # the cache only where given: latent attention (model/mla.py) takes none (model/config.kv_cache_refusal)
        return self.self_attn(x, position_ids) if cache is None else self.self_attn(x, position_ids, cache)


class Embedding(nn.Module):
    """Token embedding `tok`, plus the learned position table `pos` for gpt2."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok = EmbeddingTable(config.vocab_size, config.d_model, config.init_std)
        self.pos = None
        self.scale = config.d_model**0.5 if config.scale_embeddings else None  # Gemma: x sqrt(d), in x's dtype
        if config.flavour == "gpt2":
            self.pos = EmbeddingTable(config.max_seq_len, config.d_model, config.init_std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(input_ids)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if self.pos is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)
            x = x + self.pos(position_ids)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, ep_size: int = 1, ep_rank: int = 0) -> None:
        """ep_size, ep_rank: which experts of each MoE layer this rank holds (the expert-parallel layout comes from
        the ds_config; DeepSpeed's MoE layer moves the tokens between the ranks)."""
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, i, ep_size, ep_rank) for i in range(config.n_layer))
        self.norm = make_norm(config)
        # A tied head skips its own init (std=None) so it can never overwrite the embedding.
        head_std = None if config.tied else config.init_std
        self.lm_head = Head(config, head_std)
        if config.tied:
            self.lm_head.weight = self.embed.tok.weight
        # fn(block, x[, position_ids]) -> x, run in training instead of block(x, position_ids): how the trainer applies
        # activation checkpointing (a memory strategy, set in the ds_config) from outside.
        self.checkpoint_fn = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        head: bool = True,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids, position_ids: (B, L) int64 -> logits (B, L, vocab_size); head=False: the final norm's output
        (B, L, d_model), for a loss that applies lm_head itself (chunk by chunk: model/chunked_loss.py).

        position_ids restart at 0 at each document start; None means 0..L-1 (one document). cache: decoding
        (model/generate.py): the tokens after the cached ones, each row at its own positions.
        """
        x = self.embed(input_ids, position_ids)
        for block in self.blocks:
            x = self.run_block(block, x, position_ids) if cache is None else block(x, position_ids, cache)
        return self.lm_head(self.norm(x)) if head else self.norm(x)

    def run_block(self, block: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        if self.checkpoint_fn is not None and self.training:
            # No None argument: DeepSpeed 0.19.8's partition_activations mangles non-tensor arguments in the backward
            # (checkpointing.get_partitioned_activations_for_backward pairs each with a None size).
            args = (x,) if position_ids is None else (x, position_ids)
            if isinstance(block.mlp, MoEMLP):  # its router losses leave the checkpoint as outputs (model/moe.py)
                return checkpointed_moe_block(self.checkpoint_fn, block, *args)
            return self.checkpoint_fn(block, *args)
        return block(x, position_ids)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32.

    labels are aligned with logits (labels[:, t] is the target of position t, already shifted);
    label -100 is ignored.
    """
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross-entropies in fp32 (label -100 not counted): lm_loss times the counted tokens."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases (1-D tensors) are not decayed.

    Named, and flagged "decay": with MoE layers DeepSpeed splits each group by name into dense and expert groups
    (deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer), renaming the expert ones; the
    flag survives the split and the checkpoint, and tells apply_recipe_to_optimizer which groups decay."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            # zero.Init leaves partitioned parameters 1-D (shape [0]); ds_shape is their real shape.
            (decay if len(getattr(param, "ds_shape", param.shape)) >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay", "decay": True},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay", "decay": False},
    ]
