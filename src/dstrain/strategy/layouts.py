"""The parts a parallel layout is made of, in one list: each with the ds_config keys that choose it, whether a
strategy uses it, and its checks (the refusals resolve runs for dstrain.train and dstrain plan alike).

A layout is the parts a ds_config turns on: ZeRO partitioning, offload, pipeline stages, tensor (AutoTP), sequence
(Ulysses) and expert parallelism, activation checkpoints and where they are held, sequence tiling. The same names key
how each part is applied to the model and the engine (dstrain.train.engine.layouts.APPLIED) and what it costs
(dstrain.plan.layout_costs.COSTS); tests/test_layouts.py holds the three lists to the same names. A new part is one
entry here, one there, and one in the cost terms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dstrain.config import Recipe
from dstrain.errors import InputError
from dstrain.strategy import parallel
from dstrain.strategy.parallel import Shape
from dstrain.strategy.resolved import Strategy, offload_of

Check = Callable[[dict, Recipe, Shape], None]  # raises InputError naming the key and the fix


@dataclass(frozen=True)
class LayoutPart:
    name: str  # the key of its application (train/engine/layouts.py) and its cost terms (plan/layout_costs.py)
    keys: str  # the ds_config keys that choose it
    used_by: Callable[[Strategy], bool]  # whether a resolved strategy uses it
    # whether the sizes resolve reads first use it (the parallel parts), for the refusals of a training objective
    in_shape: Callable[[Shape], bool] | None = None
    checks: tuple[Check, ...] = ()  # run by resolve on the parallel sizes, before the world and the batch are split
    batch_checks: tuple[Check, ...] = ()  # run by resolve once the batch is split (shape.micro_batch, grad_accum)


def check_offload(config: dict, recipe: Recipe, shape: Shape) -> None:
    """Offload moves ZeRO's partitions: at stage 0 there are none, and DeepSpeed would ignore the section."""
    offloads = [k for k in ("offload_optimizer", "offload_param") if offload_of(config, k) is not None]
    if offloads and shape.zero_stage == 0:
        raise InputError(
            f"zero_optimization.{offloads[0]} needs ZeRO stage 1, 2 or 3 (stage 0 partitions nothing to offload); "
            f"set zero_optimization.stage"
        )


def check_host_checkpoints(config: dict, recipe: Recipe, shape: Shape) -> None:
    """activation_checkpointing.cpu_checkpointing holds checkpoints on the host: there must be checkpoints; and a
    pipeline's activation_checkpoint_interval must agree with the activation_checkpointing section."""
    host = config.get("activation_checkpointing", {}).get("cpu_checkpointing", False)
    if not isinstance(host, bool):
        raise InputError(f"activation_checkpointing.cpu_checkpointing={host!r}; use true or false")
    if host and shape.pp_stages > 1 and config["pipeline"].get("activation_checkpoint_interval", None) == 0:
        raise InputError(
            "activation_checkpointing.cpu_checkpointing holds activation checkpoints on the host, but "
            "pipeline.activation_checkpoint_interval=0 turns activation checkpointing off; set the interval to 1 or "
            "cpu_checkpointing to false"
        )
    interval = config.get("pipeline", {}).get("activation_checkpoint_interval") if shape.pp_stages > 1 else None
    if interval == 0 and "activation_checkpointing" in config:
        raise InputError(  # an explicit 0 is a value: neither it nor the section is overruled in silence
            "the activation_checkpointing section recomputes the blocks, but pipeline.activation_checkpoint_interval=0"
            " turns activation checkpointing off; remove the interval (every block is checkpointed) or the section"
        )


# In the order of their checks: sequence parallelism's refusals of the other model-parallel layouts come before the
# world's split into data-parallel replicas, which comes before what the pipeline and AutoTP ask of the model.
LAYOUT_PARTS: tuple[LayoutPart, ...] = (
    LayoutPart(
        "sequence",
        "sequence_parallel_size",
        lambda s: s.sp_size > 1,
        lambda shape: shape.sp_size > 1,
        (parallel.check_sequence_parallel,),
    ),
    LayoutPart(
        "zero",
        "zero_optimization.stage",
        lambda s: s.zero_stage > 0,
        lambda shape: shape.zero_stage > 0,
        (parallel.check_data_parallel,),
    ),
    LayoutPart(
        "offload",
        "zero_optimization.offload_optimizer, zero_optimization.offload_param",
        lambda s: s.offload_optimizer is not None or s.offload_param is not None,
        checks=(check_offload,),
    ),
    LayoutPart(
        "pipeline",
        "pipeline",
        lambda s: s.pp_stages > 1,
        lambda shape: shape.pp_stages > 1,
        (parallel.check_pipeline,),
        (parallel.check_pipeline_accumulation,),
    ),
    LayoutPart(
        "tensor",
        "tensor_parallel",
        lambda s: s.tp_size > 1,
        lambda shape: shape.tp_size > 1,
        (parallel.check_tensor_parallel,),
    ),
    LayoutPart(
        "expert",
        "expert_parallel",
        lambda s: s.ep_size > 1,
        lambda shape: shape.ep_size > 1,
        (parallel.check_expert_parallel,),
    ),
    LayoutPart(
        "activation_checkpoints",
        "activation_checkpointing, pipeline.activation_checkpoint_interval",
        lambda s: s.activation_checkpointing,
    ),
    LayoutPart(
        "host_checkpoints",
        "activation_checkpointing.cpu_checkpointing",
        lambda s: s.host_checkpoints,
        checks=(check_host_checkpoints,),
    ),
    # Its counts ("auto" included) are resolved, and refused, by dstrain.strategy.tiling.check_tiling.
    LayoutPart("tiling", "tiling", lambda s: s.loss_tiles > 1 or s.mlp_tiles > 1),
)
NAMES = tuple(part.name for part in LAYOUT_PARTS)


def check_layout(config: dict, recipe: Recipe, shape: Shape, refused: Mapping[str, str] | None = None) -> None:
    """Every part's checks, in the list's order: those on the sizes, or with ``shape.grad_accum`` set, those on the
    batch split. ``refused``: {part name: why} of the parts the recipe's training objective cannot run under, each
    refused first where the sizes use it."""
    for part in LAYOUT_PARTS:
        if shape.grad_accum is None and part.in_shape is not None and part.in_shape(shape):
            why = (refused or {}).get(part.name)
            if why is not None:
                raise InputError(f"{part.name} parallelism {why}")
        for check in part.batch_checks if shape.grad_accum is not None else part.checks:
            check(config, recipe, shape)


def parts_used(strategy: Strategy) -> list[str]:
    """The names of the parts ``strategy`` uses, in the list's order."""
    return [part.name for part in LAYOUT_PARTS if part.used_by(strategy)]
