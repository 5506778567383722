"""Activation memory per rank: what autograd saves for the backward of one micro-batch (tests/test_estimate.py checks
it with saved-tensor hooks), and the transient buffers of sequence parallelism. Used by dstrain.plan.memory."""

from __future__ import annotations

import math

from dstrain.config import Recipe
from dstrain.strategy.parallel import kv_replicas
from dstrain.strategy.resolve import Strategy


def activation_bytes(recipe: Recipe, strategy: Strategy, fused_norms: bool = True) -> tuple[int, int]:
    """(saved for backward, logits gradient) per rank; a pipeline's first stage holds min(stages, accumulation)
    micro-batches (1F1B), a DualPipeV rank stages + 1/2 of its share, and its rank 0 the head besides
    (strategy.pipe_schedules counts them). ``fused_norms``: torch's RMSNorm on a GPU is one fused kernel that keeps
    its input and an fp32 rstd per row; on a CPU (False) its composite path keeps fp32 copies of input and output.

    Tiling (dstrain.strategy.tiling): a chunked loss saves no log-probabilities, no head input and no labels; it
    forms the head's gradients in its forward (dstrain.model.chunked_loss), and at its last chunk holds that chunk's
    logits, fp32 scores and gradient (at most 12·T·V/n), the hidden states' gradient and the head weight's (fp32 sum and
    its copy in the model's dtype): fused_loss_bytes. A tiled MLP saves only its input (the norm's
    output, counted already): its intermediates exist for one tile of one block in the backward (mlp_tile_bytes)."""
    m, t = recipe.model, strategy.tp_size
    a = 4 if strategy.precision == "fp32" else 2
    seq = recipe.data.seq_len // strategy.sp_size  # a sequence-parallel rank's slice of each sample
    tokens = strategy.micro_batch * seq
    h, heads = m.d_model, m.n_head
    # Under SP beyond the key/value heads, attention holds each rank's repeated key/value heads
    # (train/engine/sequence.py).
    kv = m.kv_heads * kv_replicas(heads, m.kv_heads, strategy.sp_size) * m.head_dim
    q = m.n_head * m.head_dim  # d_model unless model.d_head decouples them (Qwen3)
    if m.flavour == "llama":
        norm = (a if fused_norms else 8) * h + 4  # the norm's input (fused) or fp32 input and output; rstd
        inner = 2 * q + 2 * kv + mlp_inner(m) * (strategy.mlp_tiles == 1)  # q, k, v, attention output; the MLP's
        if m.mla is not None:
            inner += latent_attention_inner(m) - 2 * q - 2 * kv
        if m.qk_norm is not None:  # the q and k norms keep theirs too, with an rstd per head (or per token)
            rstd = 4 * (heads + m.kv_heads if m.qk_norm in ("head", "l2") else 2)  # l2: Llama 4's, per head
            inner += ((a if fused_norms else 8) * (q + kv) + rstd) // a
    else:
        norm = a * (h + 2)  # LayerNorm keeps its input, mean and rstd
        inner = 2 * h + 2 * kv + mlp_inner(m) * (strategy.mlp_tiles == 1)  # q, k, v, attention output; the MLP's
    norms = 4 if m.norm_placement == "sandwich" else 2  # Gemma 3 norms each output again (and keeps its input)
    # Attention keeps q, k, v, its output and a log-sum-exp per query (flash and FlexAttention): linear in the
    # sequence, so a local block's window saves FLOPs (model.counts.flops_per_token), not activation memory.
    per_token = norms * norm + a * (2 * h + inner / t) + 4 * heads / t  # + the linears' inputs, log-sum-exp
    block = tokens * per_token + (2 * seq * m.head_dim * a if m.flavour == "llama" else 0)  # RoPE cos, sin
    offset = 4 * h if m.norm_unit_offset else 0  # Gemma's norm keeps 1 + weight, in fp32
    block += norms * offset
    layers = math.ceil(m.n_layer / strategy.pp_stages)
    if strategy.activation_checkpointing:
        stage = layers * tokens * a * h + block  # block inputs, plus one block recomputed in the backward
    else:
        stage = layers * block
    # The loss's backward holds three fp32 T x V tensors at once: the saved log-probs, nll_loss's (dense) gradient
    # and log_softmax's; the first is in `head`. (4 + a) undercounted bf16 by 2·T·V: 3 GiB of gpt2-125m's 30 on an H100.
    if strategy.loss_tiles == 1:
        head = tokens * (norm + a * h + 4 * m.vocab_size + 8)  # final norm, lm_head input, fp32 log-probs, labels
        logits_grad = tokens * 8 * m.vocab_size
    else:  # the fused chunked loss keeps gradients, not its input: the final norm's saved tensors only
        head = tokens * norm
        logits_grad = fused_loss_bytes(m, tokens, strategy.loss_tiles, a, head_trains(recipe))
    head += offset
    ids = tokens * 8
    if strategy.pp_stages == 1:
        return int(stage + head + ids), logits_grad
    from dstrain.plan.pipe_schedules import held_stages

    in_flight = held_stages(strategy.pipe_schedule, strategy.pp_stages, strategy.grad_accum)
    if strategy.pipe_schedule == "dualpipev":  # rank 0 holds the first and the last stage
        return int(in_flight * stage + head + ids), logits_grad
    return int(max(in_flight * stage + ids, stage + head)), logits_grad  # first stage vs. last stage (the head)


def fused_loss_bytes(m, tokens: int, chunks: int, a: int, head_grad: bool = True) -> int:
    """The fused chunked loss's peak, at its last chunk (dstrain.model.chunked_loss): the chunk's logits, fp32 scores
    and gradient (12·(T/n)·V bounds them, soft cap included), the hidden states' gradient (a·T·d) and the head
    weight's, summed in fp32 and cast to the model's dtype (4 + a)·V·d (4·V·d in fp32, where the cast is the sum;
    none for a frozen head: recipe.lora without lm_head in modules_to_save)."""
    head = (4 + (a if a != 4 else 0)) * m.vocab_size * m.d_model if head_grad else 0
    return tokens // chunks * 12 * m.vocab_size + tokens * a * m.d_model + head


def head_trains(recipe: Recipe) -> bool:
    """Whether the output head has a gradient: always, but with adapters that leave it frozen (recipe.lora)."""
    lora, m = recipe.lora, recipe.model
    if lora is None:
        return True
    return "lm_head" in lora.modules_to_save or (m.tied and "embed_tokens" in lora.modules_to_save)


def sp_exchange_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """Ulysses' transient all-to-all buffers of one block: q, k and v each copied contiguous and received (the
    context's exchange back is smaller); the tensors saved for the backward are counted in activation_bytes."""
    m, a = recipe.model, 4 if strategy.precision == "fp32" else 2
    tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    if m.mla is not None:  # q and k qk_head_dim wide per head, v v_head_dim (no key/value heads to repeat)
        return 2 * a * tokens * m.n_head * (2 * m.mla.qk_head_dim + m.mla.v_head_dim)
    kv = m.kv_heads * kv_replicas(m.n_head, m.kv_heads, strategy.sp_size)  # repeated beyond the key/value heads
    return 2 * a * tokens * (m.n_head * m.head_dim + 2 * kv * m.head_dim)


def latent_attention_inner(m) -> int:
    """Elements a token's latent attention (model.mla) saves: the query latent and its norm's output, the key/value
    latent with the shared rope key and its norm's output, then per head q and k (qk_head_dim), v and the output
    (v_head_dim): the compressed projections add little, the heads' q/k/v are what MLA saves like any attention."""
    mla = m.mla
    query_latent = 2 * mla.q_lora_rank if mla.q_lora_rank is not None else 0
    latent = 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    return query_latent + latent + m.n_head * (2 * mla.qk_head_dim + 2 * mla.v_head_dim)


def mlp_inner(m) -> int:
    """Elements a token's MLP saves for its backward beyond its input: SwiGLU gate, up, silu(gate) and their product;
    gpt2 up and gelu(up)."""
    return (4 if m.flavour == "llama" else 2) * m.ff_dim


def mlp_tile_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """A tiled MLP's backward: one tile of one block recomputed, its intermediates and their gradients, and the
    gradient of the block's whole input (TiledMLP's x_grad)."""
    m, a = recipe.model, 4 if strategy.precision == "fp32" else 2
    tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    tile = tokens // strategy.mlp_tiles
    return a * (2 * tile * mlp_inner(m) // strategy.tp_size + tokens * m.d_model)


def host_checkpoint_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """Checkpointed block inputs held in pinned host memory (activation_checkpointing.cpu_checkpointing), per rank:
    every block's but the last, which DeepSpeed keeps on the device for the backward's first recompute
    (``_ActivationOffloadEngine(keep_last_count=1)``); a pipeline's first stage holds its in-flight micro-batches'."""
    if not (strategy.activation_checkpointing and strategy.host_checkpoints):
        return 0
    m, a = recipe.model, 4 if strategy.precision == "fp32" else 2
    tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    layers = math.ceil(m.n_layer / strategy.pp_stages)
    in_flight = 1.0
    if strategy.pp_stages > 1:
        from dstrain.plan.pipe_schedules import held_stages

        in_flight = held_stages(strategy.pipe_schedule, strategy.pp_stages, strategy.grad_accum)
    return int((in_flight * layers - 1) * tokens * a * m.d_model)
