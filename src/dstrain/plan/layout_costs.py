"""What each part of a layout costs beyond the model states and collectives every layout has, keyed by the names
of dstrain.strategy.layouts.LAYOUT_PARTS: the memory a rank holds for it, the FLOPs it adds, and the seconds a step
spends on it besides compute and communication. dstrain.plan.memory.estimate and dstrain.plan.time_model.predict
add the terms of the parts a strategy uses and name none of them. (The model states' share under ZeRO, tensor,
pipeline and expert parallelism is the parameter count's business, dstrain.plan.param_counts; the bytes each
collective moves, dstrain.plan.traffic.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dstrain.config import Recipe
from dstrain.plan.activations import host_checkpoint_bytes, mlp_tile_bytes, sp_exchange_bytes
from dstrain.plan.bubble import bubble_fraction
from dstrain.plan.memory_parts import Part
from dstrain.plan.param_counts import ParamCounts
from dstrain.plan.traffic import dtype_bytes
from dstrain.strategy.layouts import parts_used
from dstrain.strategy.resolved import Strategy

GBIT = 1e9 / 8


class Rates(Protocol):
    """What the terms read of a device model (dstrain.plan.time_model.Device)."""

    @property
    def host_gbps(self) -> float: ...

    @property
    def cpu_adam_params_per_s(self) -> float: ...

    @property
    def overlaps_communication(self) -> bool: ...


@dataclass(frozen=True)
class Costs:
    """One part's terms; each is optional."""

    # parts a rank holds for it (dstrain.plan.memory_parts.Part)
    memory: Callable[[Recipe, Strategy], list[Part]] | None = None
    # the step's FLOPs per rank with it, given them without it (in the list's order: later parts see earlier ones)
    flops: Callable[[Recipe, Strategy, float], float] | None = None
    # seconds a step spends on it besides compute and communication, given the compute's seconds
    seconds: Callable[[Recipe, Strategy, ParamCounts, Rates, float], float] | None = None


def ulysses_buffers(recipe: Recipe, strategy: Strategy) -> list[Part]:
    size = sp_exchange_bytes(recipe, strategy)
    return [Part("buffers", "Ulysses all-to-all (q, k, v)", "device", size, 0, "2a·(T/sp)·(d + 2·kv)")]


def head_unsharded(recipe: Recipe, strategy: Strategy, flops: float) -> float:
    """AutoTP does not shard the output head: each TP rank computes all of it."""
    m, world = recipe.model, strategy.topology.world_size
    tokens_step = recipe.train.global_batch * recipe.data.seq_len
    return flops + 6 * m.vocab_size * m.d_model * tokens_step / world * (strategy.tp_size - 1)


def recomputed(recipe: Recipe, strategy: Strategy, flops: float) -> float:
    """Each checkpointed block runs its forward again in the backward."""
    return flops * 4 / 3


def pipeline_bubble(recipe: Recipe, strategy: Strategy, counts: ParamCounts, device: Rates, compute_s: float) -> float:
    return compute_s * bubble_fraction(strategy.pipe_schedule, strategy.pp_stages, strategy.grad_accum)


def offload_seconds(recipe: Recipe, strategy: Strategy, counts: ParamCounts, device: Rates, compute_s: float) -> float:
    """The optimizer's states to the host and CPU Adam's step; offloaded parameters fetched each micro-batch."""
    part = counts.per_rank / strategy.zero_partitions
    b = dtype_bytes(strategy.precision)
    seconds = 0.0
    if strategy.offload_optimizer:
        seconds += part * (4 + b) / (device.host_gbps * GBIT) + part / device.cpu_adam_params_per_s
    if strategy.offload_param:
        seconds += 2 * strategy.grad_accum * counts.per_rank * b / (device.host_gbps * GBIT)
    return seconds


def host_checkpoint_parts(recipe: Recipe, strategy: Strategy) -> list[Part]:
    """The checkpointed block inputs, pinned on the host (counted out of the device's saved activations)."""
    host = host_checkpoint_bytes(recipe, strategy)
    return [
        Part("activations", "checkpointed block inputs, pinned on the host", "cpu", host, host, "(layers - 1)·a·T·d")
    ]


def host_checkpoint_seconds(
    recipe: Recipe, strategy: Strategy, counts: ParamCounts, device: Rates, compute_s: float
) -> float:
    """Checkpointed block inputs to the host in the forward and back in the backward (cpu_checkpointing): DeepSpeed
    copies them on a side stream, so only what outlasts the compute shows (all of it where nothing overlaps)."""
    moved = 2 * strategy.grad_accum * host_checkpoint_bytes(recipe, strategy) / (device.host_gbps * GBIT)
    return max(0.0, moved - compute_s) if device.overlaps_communication else moved


def tile_parts(recipe: Recipe, strategy: Strategy) -> list[Part]:
    if strategy.mlp_tiles == 1:  # the chunked loss's tile is the loss's own part (dstrain.plan.memory)
        return []
    name = f"MLP: 1 of {strategy.mlp_tiles} tiles recomputed (backward)"
    tile = mlp_tile_bytes(recipe, strategy)
    return [Part("activations", name, "device", tile, 0, "2a·(T/m)·MLP intermediates + a·T·d")]


def tiled_mlp_recompute(recipe: Recipe, strategy: Strategy, flops: float) -> float:
    """A tiled MLP runs each MLP's forward again (2·d·f per matrix). The chunked loss adds none: it runs the head's
    matmuls once, forming its gradients in the forward (dstrain.model.chunked_loss)."""
    if strategy.mlp_tiles == 1:
        return flops
    m = recipe.model
    matrices = 3 if m.flavour == "llama" else 2
    per_token = 2.0 * matrices * m.d_model * m.ff_dim * (m.n_layer - m.n_moe_layers)
    return flops + per_token * recipe.train.global_batch * recipe.data.seq_len / strategy.topology.world_size


COSTS: dict[str, Costs] = {
    "sequence": Costs(memory=ulysses_buffers),  # its traffic: dstrain.plan.traffic (the all-to-alls)
    "zero": Costs(),  # its share of the states: dstrain.plan.memory.model_state_parts; its traffic: plan.traffic
    "offload": Costs(seconds=offload_seconds),  # its memory: model_state_parts' host rows
    "pipeline": Costs(seconds=pipeline_bubble),  # its stage's parameters: dstrain.plan.param_counts
    "tensor": Costs(flops=head_unsharded),  # its slice of the parameters: param_counts; its traffic: plan.traffic
    "expert": Costs(),  # its experts: dstrain.plan.param_counts; its all-to-alls: dstrain.plan.traffic
    "activation_checkpoints": Costs(flops=recomputed),  # what stays saved: dstrain.plan.activations
    "host_checkpoints": Costs(memory=host_checkpoint_parts, seconds=host_checkpoint_seconds),
    "tiling": Costs(memory=tile_parts, flops=tiled_mlp_recompute),
}


def memory_parts(recipe: Recipe, strategy: Strategy) -> list[Part]:
    """What a rank holds for the parts ``strategy`` uses, in the list's order."""
    return [p for name in parts_used(strategy) if (memory := COSTS[name].memory) for p in memory(recipe, strategy)]


def with_flops(recipe: Recipe, strategy: Strategy, flops: float) -> float:
    """The step's FLOPs per rank once each used part has added its own."""
    for name in parts_used(strategy):
        if (term := COSTS[name].flops) is not None:
            flops = term(recipe, strategy, flops)
    return flops


def seconds(recipe: Recipe, strategy: Strategy, counts: ParamCounts, device: Rates, compute_s: float) -> dict:
    """{part name: seconds} of the used parts that spend any."""
    spent = {}
    for name in parts_used(strategy):
        if (term := COSTS[name].seconds) is not None:
            spent[name] = term(recipe, strategy, counts, device, compute_s)
    return spent
