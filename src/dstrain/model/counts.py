"""Parameter and FLOP counts of a GPTConfig, without torch: what the metrics (MFU), the estimate and the planner
count, equal to the built model's (tests/test_model.py)."""

from __future__ import annotations

from dstrain.model.config import GPTConfig


def mlp_params(config: GPTConfig, width: int, expert: bool = False) -> int:
    """Parameters of one MLP of the flavour with hidden width `width` (an expert is one)."""
    d = config.d_model
    if config.flavour == "gpt2":
        return d * width + width + width * d + d
    biases = 2 * width + d if expert and config.moe is not None and config.moe.expert_bias else 0
    return 3 * d * width + biases


def num_params(config: GPTConfig, exclude_embeddings: bool = False, active: bool = False) -> int:
    """Parameter count of GPT(config), a tied matrix counted once.

    exclude_embeddings drops the token (and position) tables; an untied lm_head is still counted.
    active counts, in each MoE layer, the router and the top_k experts a token runs through (not all experts).
    """
    d, v = config.d_model, config.vocab_size
    q_out, kv_out = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    attention = d * q_out + 2 * d * kv_out + q_out * d
    if config.flavour == "gpt2":
        attention += q_out + 2 * kv_out + d
    if config.qkv_bias:
        attention += q_out + 2 * kv_out
    if config.o_bias:
        attention += d
    if config.qk_norm in ("head", "projection"):  # l2 (Llama 4) has no weight
        attention += 2 * config.head_dim if config.qk_norm == "head" else q_out + kv_out
    if config.attention_sinks:
        attention += config.n_head
    if config.mla is not None:
        attention = config.mla.params(d, config.n_head)
    norm = 2 * d if config.flavour == "gpt2" else d
    block_norms = 4 * norm if config.norm_placement == "sandwich" else 2 * norm
    dense_block = attention + mlp_params(config, config.ff_dim) + block_norms
    total = (config.n_layer - config.n_moe_layers) * dense_block + norm + (0 if config.tied else v * d)
    if config.moe is not None:
        experts = config.moe.top_k if active else config.moe.num_experts
        router = (d + config.moe.router_bias) * config.moe.num_experts
        moe_block = attention + block_norms + router + experts * mlp_params(config, config.expert_dim, expert=True)
        shared = config.moe.n_shared_experts  # DeepSeekMoE: one MLP of all shared experts
        moe_block += mlp_params(config, config.expert_dim * shared) if shared else 0
        total += config.n_moe_layers * moe_block
    embeddings = v * d + (config.max_seq_len * d if config.flavour == "gpt2" else 0)
    return total if exclude_embeddings else total + embeddings


def describe_params(config: GPTConfig) -> str:
    """The parameter line a run starts with: total, and with MoE the active parameters per token."""
    line = f"parameters: {num_params(config) / 1e6:,.2f}M"
    if config.moe is None:
        return line
    return (
        f"{line} total, {num_params(config, active=True) / 1e6:,.2f}M active per token "
        f"(top {config.moe.top_k} of {config.moe.num_experts} experts in {config.n_moe_layers} MoE layers)"
    )


def flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6*N + 12*n_layer*n_head*head_dim*seq_len (head_dim*n_head is
    d_model unless model.d_head decouples them).

    N = the ACTIVE non-embedding parameters (with MoE: the router and the top_k experts of each MoE layer)
    plus the vocab_size*d_model output projection, counted whether or not it is tied (the logits matmul
    runs either way); the position table and embedding lookups cost no matmul FLOPs. The second term is
    the attention scores and weighted sum (QK^T and AV), counted over the full L x L square as in
    Kaplan et al. / PaLM, ignoring the causal half; a local block (model.layer_types, sliding_window W) over the
    L x min(W, L) band its queries attend to, which FlexAttention's block mask lets the GPU skip to.
    """
    n = num_params(config, exclude_embeddings=True, active=True) + (
        config.vocab_size * config.d_model if config.tied else 0
    )
    # keys per query, summed: a local block's window, a chunked block's chunk (Llama 4), else the whole sequence
    keys = sum(min(config.window(i) or config.chunk(i) or seq_len, seq_len) for i in range(config.n_layer))
    value_dim = config.head_dim if config.mla is None else config.mla.v_head_dim  # MLA: q.k and a.v differ in width
    return 6 * n + 6 * config.n_head * (config.head_dim + value_dim) * keys
