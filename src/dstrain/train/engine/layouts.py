"""How each part of a layout (dstrain.strategy.layouts.LAYOUT_PARTS, by the same names) is applied to the model and
the engine, from outside the model file: what builds the model in place of the plain GPT, the context the plain
GPT is built in, what is done to the built model before deepspeed.initialize (and the process groups DeepSpeed is
told of), and what is done to the engine after it. build.py calls the hooks of the parts a strategy uses, in the
list's order, and names none of them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch

from dstrain.config import Recipe
from dstrain.strategy.layouts import parts_used
from dstrain.strategy.resolved import Strategy


@dataclass(frozen=True)
class Applied:
    """One part's hooks; each is optional."""

    # builds the whole model in place of the plain GPT (pipeline stages)
    build: Callable[[Recipe, Strategy], torch.nn.Module] | None = None
    # the plain GPT is built inside it (ZeRO-3's zero.Init)
    building: Callable[[Strategy], contextlib.AbstractContextManager] | None = None
    # on the built model, before its weights are loaded (init_from) or converted
    on_model: Callable[[torch.nn.Module, Recipe, Strategy], None] | None = None
    # on the model just before deepspeed.initialize; may return the process-group holder DeepSpeed takes as mpu
    before_engine: Callable[[torch.nn.Module, Strategy], Any] | None = None
    # on the engine deepspeed.initialize returned
    on_engine: Callable[[Any, Strategy], None] | None = None


def build_pipeline(recipe: Recipe, strategy: Strategy) -> torch.nn.Module:
    """A PipelineModule whose layers each rank builds only for its own stage."""
    from dstrain.model.pipe import build_pipeline as stages

    pipeline = strategy.deepspeed_config.get("pipeline", {})
    head_loss = None
    if strategy.loss_tiles > 1:
        from dstrain.train.engine import tiling

        head_loss = tiling.pipeline_loss(strategy.loss_tiles, recipe.model.logit_softcap)
    # The ds_config's activation_checkpointing section alone means every block, as for the plain model.
    return stages(
        recipe.model,
        recipe.seed,
        strategy.pp_stages,
        partition_method=pipeline.get("partition_method", "parameters"),
        activation_checkpoint_interval=strategy.pipe_checkpoint_interval,
        schedule=pipeline.get("schedule", "1f1b"),
        head_loss=head_loss,
    )


def checkpoint_blocks(model: torch.nn.Module, recipe: Recipe, strategy: Strategy) -> None:
    if hasattr(model, "checkpoint_fn"):  # the plain GPT; pipeline stages checkpoint by their interval
        model.checkpoint_fn = deepspeed.checkpointing.checkpoint  # configured per engine in configure_checkpoints


def ulysses(model: torch.nn.Module, strategy: Strategy):
    """Ulysses: attention wrapped from outside, DeepSpeed told the sequence-parallel groups through mpu."""
    from dstrain.train.engine import sequence

    mpu = sequence.init_groups(strategy.sp_size)
    sequence.apply(model, mpu.get_sequence_parallel_group())
    return mpu


def tile_mlps(model: torch.nn.Module, strategy: Strategy) -> None:
    if strategy.mlp_tiles > 1:  # the loss's tiles are the forward's (train/step/forward.py) or the pipeline's head
        from dstrain.train.engine import tiling

        tiling.tile_mlps(model, strategy.mlp_tiles)


def configure_checkpoints(engine, strategy: Strategy) -> None:
    """deepspeed.checkpointing reads its options (partition_activations, cpu_checkpointing, ...) from module
    globals, set here from the ds_config's section. cpu_checkpointing holds each block's input in host memory
    (train/engine/host_checkpoints.py). Partitioning splits each saved block input over the
    tensor-parallel group, which holds it replicated; without one there is nothing to partition over (a pipeline's
    grid is no such group, and DeepSpeed 0.19.8's configure() fails on it: it has no
    get_tensor_model_parallel_group)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from dstrain.train.engine import host_checkpoints

    host_checkpoints.install()
    checkpointing.mpu = None  # configure() keeps a previous engine's grid when given none (DeepSpeed 0.19.8)
    section = strategy.deepspeed_config.get("activation_checkpointing", {})  # none: a pipeline interval alone
    tensor_parallel = strategy.tp_size > 1
    # Options by hand: configure(deepspeed_config=...) re-checks the batch arithmetic against the world size, which
    # fails when model parallelism makes the data-parallel size smaller.
    deepspeed.checkpointing.configure(
        engine.mpu if tensor_parallel else None,
        partition_activations=tensor_parallel and section.get("partition_activations", False),
        contiguous_checkpointing=tensor_parallel and section.get("contiguous_memory_optimization", False),
        checkpoint_in_cpu=section.get(
            "cpu_checkpointing", False
        ),  # on any layout: dstrain.train.engine.host_checkpoints
        num_checkpoints=section.get("number_checkpoints"),
        synchronize=section.get("synchronize_checkpoint_boundary", False),
        profile=section.get("profile", False),
    )


def sum_head_norm_grads(engine, strategy: Strategy) -> None:
    """q/k norms per head (model.qk_norm head: Qwen3) hold one weight that every head uses. Under AutoTP each rank
    keeps the whole weight but only its slice of the heads, so its gradient is a partial sum over those heads; AutoTP
    (DeepSpeed 0.19.8) reduces no replicated parameter over the tensor-parallel group (the others see the whole hidden
    state, so their gradients agree already). A hook sums the partial gradients, as Megatron-LM all-reduces its
    sequence-parallel norm gradients; tests/test_parallel.py holds TP2 to the plain model's gradient norms."""
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    for name, param in engine.module.named_parameters():
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            param.register_hook(summed)


def check_expert_groups(engine, strategy: Strategy) -> None:
    """The experts build_model gave this rank are those of its place in DeepSpeed's expert-parallel group."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    for module in engine.module.modules():
        if isinstance(module, MoE) and module.ep_size > 1:
            placed = groups._get_expert_parallel_rank(module.expert_group_name)
            if placed != strategy.ep_rank(torch.distributed.get_rank()):
                raise RuntimeError(
                    f"DeepSpeed placed this rank at expert-parallel index {placed}, build_model assumed "
                    f"{strategy.ep_rank(torch.distributed.get_rank())}"
                )


APPLIED: dict[str, Applied] = {
    "zero": Applied(
        # ZeRO-3: built inside zero.Init, so no rank ever holds all of it
        building=lambda s: (
            deepspeed.zero.Init(config_dict_or_path=s.deepspeed_config)
            if s.zero_stage == 3
            else contextlib.nullcontext()
        )
    ),
    "offload": Applied(),  # DeepSpeed's own, from the ds_config
    "pipeline": Applied(build=build_pipeline),
    "tensor": Applied(on_engine=sum_head_norm_grads),  # AutoTP shards the plain GPT inside deepspeed.initialize
    "sequence": Applied(before_engine=ulysses),
    "expert": Applied(on_engine=check_expert_groups),  # the GPT is built with this rank's experts (build_model)
    "activation_checkpoints": Applied(on_model=checkpoint_blocks, on_engine=configure_checkpoints),
    "host_checkpoints": Applied(),  # configure_checkpoints' checkpoint_in_cpu (train/engine/host_checkpoints.py)
    "tiling": Applied(before_engine=tile_mlps),
}


def applied(strategy: Strategy) -> list[Applied]:
    """The hooks of the parts ``strategy`` uses, in the list's order."""
    return [APPLIED[name] for name in parts_used(strategy)]
