"""What LoRA and QLoRA change in the memory, traffic and time models (recipe.lora): the frozen base keeps its
parameters (in the training dtype, or its block projections in NF4: dstrain.adapters.qlora_checks.packed_bytes, 0.52
byte a weight) but no gradient and no optimizer state; the adapters (and lora.modules_to_save) are the Ψ of
dstrain.plan.memory's table, their gradients and Adam state counted as a full model's are. Torch-free.

Per rank, with Ψ_a the trainable parameters, Ψ_b the frozen ones in the training dtype (b bytes), Q the NF4 bytes:

    stage 0-2   base b·Ψ_b + Q whole on every rank (replicated)      adapters: memory.model_state_parts(Ψ_a)
    stage 3     base (b·Ψ_b + Q)/N, gathered module by module in the forward and again in the backward

Activations beyond the dense model's (activations.py counts every projection's input, which the adapter's A saves
when the frozen weight no longer does): per adapted projection, A's output (a·T·r) and, with lora.dropout, the
dropped input and its mask (a·T·in + T·in); one block's worth under activation checkpointing. QLoRA adds the
dequantized weight of one projection at a time (b·largest, torchao's linear_nf4 makes it in the forward and again in
the backward).

Compute: a frozen matrix's weight gradient is never formed, so the base costs 4 FLOPs a parameter a token (forward
and input gradient) instead of 6; the adapters 6 each. The dequantization (elementwise, bandwidth-bound) is not
timed. Under tensor parallelism the adapters are whole on every rank; under pipeline stages their share is the
stage's share of the model (the planner's approximation; QLoRA is refused with both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dstrain.adapters.config import LoraConfig, adapter_params, layer_shapes, target_names
from dstrain.adapters.qlora_checks import packed_bytes
from dstrain.config import Recipe
from dstrain.model.counts import flops_per_token, num_params
from dstrain.plan.activations import head_trains
from dstrain.plan.memory_parts import Part
from dstrain.plan.param_counts import ParamCounts
from dstrain.strategy.resolve import Strategy


@dataclass(frozen=True)
class AdapterCounts:
    trainable: int  # adapters' A and B, and the modules lora.modules_to_save names, on one rank
    persistent: int  # ZeRO-3: trainable tensors of at most stage3_param_persistence_threshold elements (kept whole)
    frozen: int  # the base's parameters held in the training dtype on one rank (NF4 ones not included)
    quantized: int  # the base's parameters held in NF4 on one rank
    quantized_bytes: int  # their packed bytes
    largest_quantized: int  # elements of the largest NF4 matrix (dequantized one at a time)


def adapter_counts(recipe: Recipe, counts: ParamCounts, pp_stages: int = 1, threshold: int = 0) -> AdapterCounts:
    """The split of ``counts.per_rank`` into what trains and what is frozen (module docstring); ``threshold``:
    ZeRO-3's stage3_param_persistence_threshold."""
    lora, m = recipe.lora, recipe.model
    assert lora is not None
    shapes = layer_shapes(m)
    matrices = [(lora.rank * i, o * lora.rank) for i, o in map(shapes.__getitem__, target_names(lora, m))]
    adapters = adapter_params(replace(lora, modules_to_save=[]), m)
    persistent = m.n_layer * sum(x for pair in matrices for x in pair if x <= threshold)
    share = counts.per_rank / counts.total if pp_stages > 1 else 1.0  # a pipeline stage's share of the model
    saved = math.ceil(saved_params(recipe) * share)
    quantized = quantized_bytes = largest = 0
    if lora.quantize_base is not None:
        sizes = [i * o for i, o in map(shapes.__getitem__, target_names(LoraConfig(), m))]
        layers = math.ceil((m.n_layer - m.n_moe_layers) * share)
        quantized, quantized_bytes = layers * sum(sizes), layers * sum(packed_bytes(n) for n in sizes)
        largest = max(sizes)
    return AdapterCounts(
        trainable=math.ceil(adapters * share) + saved,
        persistent=math.ceil(persistent * share),
        frozen=counts.per_rank - saved - quantized,
        quantized=quantized,
        quantized_bytes=quantized_bytes,
        largest_quantized=largest,
    )


def saved_params(recipe: Recipe) -> int:
    """Parameters of lora.modules_to_save (one matrix for both when the embeddings are tied)."""
    assert recipe.lora is not None
    return adapter_params(recipe.lora, recipe.model) - adapter_params(
        replace(recipe.lora, modules_to_save=[]), recipe.model
    )


def frozen_base_parts(strategy: Strategy, adapter: AdapterCounts) -> list[Part]:
    """The frozen base on one rank: whole under ZeRO 0-2, a 1/N partition under ZeRO-3 (on the host with
    offload_param); the same in every phase."""
    s, n, dtype = strategy.zero_stage, strategy.zero_partitions, strategy.precision
    b = 4 if dtype == "fp32" else 2
    where = (strategy.offload_param or "device") if s == 3 else "device"
    share, of = (n, f", 1/{n} partition") if s == 3 else (1, "")
    parts = []
    frozen = b * math.ceil(adapter.frozen / share)
    name = f"frozen base ({dtype}){of}: no gradient, no optimizer state"
    parts.append(Part("parameters", name, where, frozen, frozen, f"{b}Ψ_base{'/N' if s == 3 else ''}"))
    if adapter.quantized:
        q = math.ceil(adapter.quantized_bytes / share)
        name = f"frozen base, NF4 (4 bits + block scales){of}"
        parts.append(Part("parameters", name, where, q, q, f"0.516·Ψ_nf4{'/N' if s == 3 else ''}"))
    return parts


def adapter_activation_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """What the adapters save for the backward on one rank beyond the dense model (module docstring)."""
    lora, m = recipe.lora, recipe.model
    assert lora is not None
    a = 4 if strategy.precision == "fp32" else 2
    tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    shapes = layer_shapes(m)
    per_block = 0
    for name in target_names(lora, m):
        fan_in = shapes[name][0]
        per_block += a * tokens * lora.rank + ((a + 1) * tokens * fan_in if lora.dropout else 0)
    layers = 1 if strategy.activation_checkpointing else m.n_layer
    if strategy.pp_stages > 1:
        layers = math.ceil(layers / strategy.pp_stages)
    return layers * per_block


def adapter_parts(recipe: Recipe, strategy: Strategy, adapter: AdapterCounts) -> list[Part]:
    """The activations and buffers LoRA and QLoRA add (module docstring)."""
    parts = [
        Part(
            "activations",
            "LoRA: A's outputs (and dropout's inputs and masks)",
            "device",
            adapter_activation_bytes(recipe, strategy),
            0,
            "a·T·r (+ (a + 1)·T·in with dropout) per adapter",
        )
    ]
    if adapter.quantized:
        b = 4 if strategy.precision == "fp32" else 2
        size = b * adapter.largest_quantized
        name = "NF4 weight dequantized for its matmul"
        parts.append(Part("buffers", name, "device", size, 0, "b·largest NF4 matrix"))
    return parts


def lora_flops_per_token(recipe: Recipe) -> tuple[float, float]:
    """Training FLOPs per token with adapters, and the backward's share of them (module docstring): the dense
    model's (flops_per_token) less the weight gradients of the frozen matrices (2 a parameter), plus 6 per adapter
    parameter."""
    lora, m = recipe.lora, recipe.model
    assert lora is not None
    full = flops_per_token(m, recipe.data.seq_len)
    table = m.vocab_size * m.d_model
    matmul = num_params(m, exclude_embeddings=True, active=True) + (table if m.tied else 0)
    frozen = matmul - (table if head_trains(recipe) else 0)
    adapters = adapter_params(replace(lora, modules_to_save=[]), m)
    flops = full - 2 * frozen + 6 * adapters
    forward = full / 3 + 2 * adapters
    return flops, 1 - forward / flops
