"""Building the DeepSpeed engine: the model (plain, under zero.Init for ZeRO-3, or as pipeline stages),
parameter groups, schedule, and where this rank sits in DeepSpeed's data-parallel groups."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import deepspeed
import torch

from dstrain.config import Recipe
from dstrain.errors import warn
from dstrain.model.gpt import GPT, param_groups
from dstrain.monitors.settings import MONITOR_BLOCKS
from dstrain.strategy.resolve import Strategy
from dstrain.train.engine import grad_norm, muon_zero
from dstrain.train.engine.schedule import build_scheduler


def build_model(recipe: Recipe, strategy: Strategy) -> torch.nn.Module:
    """The GPT with the same initial weights under every strategy.

    Plain by default; under ZeRO-3 built inside zero.Init so no rank ever holds all of it; with
    pipeline stages a PipelineModule whose layers each rank builds only for its own stage.
    AutoTP shards the plain GPT inside deepspeed.initialize.
    """
    if strategy.pp_stages > 1:
        from dstrain.model.pipe import build_pipeline

        pipeline = strategy.ds_config.get("pipeline", {})
        head_loss = None
        if strategy.loss_tiles > 1:
            from dstrain.train.engine import tiling

            head_loss = tiling.pipeline_loss(strategy.loss_tiles, recipe.model.logit_softcap)
        return build_pipeline(
            recipe.model,
            recipe.seed,
            strategy.pp_stages,
            partition_method=pipeline.get("partition_method", "parameters"),
            activation_checkpoint_interval=strategy.pipe_checkpoint_interval,
            schedule=pipeline.get("schedule", "1f1b"),
            head_loss=head_loss,
        )
    torch.manual_seed(recipe.seed)  # identical initial weights on every rank and under every strategy
    init = (
        deepspeed.zero.Init(config_dict_or_path=strategy.ds_config)
        if strategy.zero_stage == 3
        else contextlib.nullcontext()
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with init:
        model = GPT(recipe.model, strategy.ep_size, strategy.ep_rank(rank))
    if strategy.activation_checkpointing:
        model.checkpoint_fn = deepspeed.checkpointing.checkpoint  # configured per engine in build_engine
    return model


STALE_BUILD_LOCK_S = 1800  # DeepSpeed's CPU ops compile in minutes; a lock this old has no builder left


def warn_stale_build_locks() -> list[Path]:
    """Name the JIT build locks that a killed build left behind, before DeepSpeed waits on one.

    torch.utils.cpp_extension marks a build in progress with a bare ``<op>/lock`` file (FileBaton) that
    has no owner and never expires: after a run is killed while DeepSpeedCPUAdam or FusedAdam compiles,
    every later start that needs that op waits forever at 0% CPU, printing nothing.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        locks = Path(root).glob("*/lock")
    else:
        from torch.utils.cpp_extension import get_default_build_root

        locks = Path(get_default_build_root()).glob("*/*/lock")  # <python>_<accelerator>/<op>/lock
    stale = []
    for lock in locks:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # a build on another rank or job finished meanwhile
            continue
        if age > STALE_BUILD_LOCK_S:
            stale.append(lock)
            warn(
                f"{lock} is {age / 60:.0f} minutes old: a killed build of a DeepSpeed op left it, and a run "
                f"that needs that op will wait on it forever; if nothing is compiling, remove it"
            )
    return stale


def make_arch_list_readable_by_deepspeed() -> None:
    """Drop arch-specific suffixes ("9.0a", "10.0f") from TORCH_CUDA_ARCH_LIST for DeepSpeed's JIT op builds.

    DeepSpeed 0.19.8's op builder (ops/op_builder/builder.py, compute_capability_args) sorts the entries as
    integers and raises ValueError on a suffix that torch and CUDA images use (seen on an H100 image that sets
    "9.0a"), so FusedAdam, the default optimizer of every GPU config, fails to build. Its ops need no
    arch-specific instructions. tests/test_gpu_check.py::test_deepspeed_cannot_read_arch_suffixes notices a fix.
    """
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    readable = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", archs)
    if readable != archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = readable


def build_engine(recipe: Recipe, strategy: Strategy, model: torch.nn.Module):
    """deepspeed.initialize with the optimizer from the ds_config and the schedule from the recipe."""
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one warning per node, whose cache it is
        warn_stale_build_locks()
    make_arch_list_readable_by_deepspeed()
    # DeepSpeed 0.19.8 leaves the previous engine's process grid (pipeline grid, AutoTP groups) in the module-global
    # deepspeed.utils.groups.mpu, and an engine built without one then takes its data-parallel group from it: a
    # second run in one process (tests, notebooks) crashes or reduces over the wrong ranks. Engines that have a
    # grid set it again. tests/test_parallel.py::test_deepspeed_leaks_the_pipeline_grid notices a fix upstream.
    deepspeed.utils.groups.mpu = None
    mpu = None
    if strategy.sp_size > 1:  # Ulysses: attention wrapped from outside, DeepSpeed told the groups through mpu
        from dstrain.train.engine import sequence

        mpu = sequence.init_groups(strategy.sp_size)
        sequence.apply(model, mpu.get_sequence_parallel_group())
    if strategy.mlp_tiles > 1:
        from dstrain.train.engine import tiling

        tiling.tile_mlps(model, strategy.mlp_tiles)
    # "expert_parallel" is dstrain's to read (strategy: the classic MoE layer's size); given to DeepSpeed it would turn
    # on AutoEP, which finds no layer of its own here. The monitor blocks are dstrain's to write (dstrain.monitors, at
    # the optimizer step): DeepSpeed's own writers would log its events at the sample count, a second x-axis.
    ds_config = {k: v for k, v in strategy.ds_config.items() if k not in ("expert_parallel", *MONITOR_BLOCKS)}
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, recipe.optim.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: build_scheduler(opt, recipe.total_steps, recipe.optim, recipe.schedule),
        mpu=mpu,
    )
    if strategy.activation_checkpointing:
        configure_activation_checkpointing(engine, strategy)
    if strategy.tp_size > 1:
        sum_head_norm_grads_over_tp(engine.module)
    check_expert_groups(engine, strategy)
    if "compile" in strategy.ds_config:
        # DeepSpeed 0.19.8 reads the "compile" section but leaves engine.compile() to the caller: here the
        # section's presence is the switch, so torch.compile is one ds_config swap like every other strategy.
        engine.compile()
    grad_norm.install(engine)  # ZeRO-0 fp32: DeepSpeed keeps no norm (and pipelines clip by the wrong one)
    grad_norm.pad_group_norms(engine)  # pipelines: a stage without a no-decay group would hang the norm
    if recipe.optim.kind == "muon":
        muon_zero.install(engine)  # ZeRO-1/2: clip the raw gradient, then orthogonalise, as ZeRO-0 does
        run_muon_eagerly_on_cpu(engine.optimizer)
    return engine


def sum_head_norm_grads_over_tp(model: torch.nn.Module) -> None:
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

    for name, param in model.named_parameters():
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            param.register_hook(summed)


def run_muon_eagerly_on_cpu(optimizer) -> None:
    """DeepSpeed 0.19.8 torch.compiles muon_update (original_muon.py, @compiler.compile()): on a CPU, inductor's C++
    build of it takes minutes per matrix shape before the first step (172 s for the small test model on 2 busy
    cores), to save milliseconds a step. There the step runs it eagerly; elsewhere as DeepSpeed compiles it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    step = optimizer.step

    def eager_step(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    optimizer.step = eager_step


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


def configure_activation_checkpointing(engine, strategy: Strategy) -> None:
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
    section = strategy.ds_config.get("activation_checkpointing", {})  # none: a pipeline interval alone
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


def apply_recipe_to_optimizer(engine, recipe: Recipe) -> None:
    """After a checkpoint load, make the current recipe the truth: DeepSpeed 0.19.8 restores each parameter
    group's lr, weight_decay, betas and eps, the ZeRO / bf16 wrappers' clip_grad and the scheduler's base_lrs
    from the checkpoint, so a changed optim.* or schedule.* would be silently ignored. The moments, the step
    count and the scheduler's position stay the checkpoint's; the lr of the next step is the schedule's at it."""
    optim = recipe.optim
    wrapper = engine.optimizer
    groups = wrapper.param_groups  # the wrappers forward to the torch optimizer's groups
    backup = getattr(wrapper, "backup_optimizer", None)  # ZeRO-3 partial offload's GPU-side AdamW
    for group_list in [groups] + ([backup.param_groups] if backup is not None else []):
        for index, group in enumerate(group_list):  # engine.param_groups: matrices (decayed) first, then the rest
            group["weight_decay"] = optim.weight_decay if decays(group, index) else 0.0
            if group.get("use_muon", False):
                group.update(momentum=optim.muon.momentum, ns_method=optim.muon.ns_method)
            else:
                group.update(betas=tuple(optim.betas), eps=optim.eps)
    while wrapper is not None:
        if hasattr(wrapper, "clip_grad"):
            wrapper.clip_grad = optim.grad_clip
        wrapper = getattr(wrapper, "optimizer", None)
    engine._config.gradient_clipping = optim.grad_clip  # what ZeRO-0 fp32 clips with (engine.gradient_clipping())
    scheduler = engine.lr_scheduler
    # Its lambdas are build_engine's, from the current recipe (closures, which no checkpoint holds); base_lrs and
    # each group's lr came back from the checkpoint. The lr of the next step is then what an uninterrupted run of
    # the current recipe computes for it, to the bit.
    scheduler.base_lrs = [optim.muon.lr if group.get("use_muon", False) else optim.lr for group in groups]
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def decays(group: dict, index: int) -> bool:
    """Whether a parameter group of the engine's optimizer takes weight decay: param_groups' "decay" flag; DeepSpeed's
    Muon split (engine._muon_param_groups) drops it but names each half after param_groups' group ("decay-muon-params",
    "no_decay-adam-params"), and a Muon group always decays; ZeRO-3 partial offload's backup AdamW (DeepSpeed 0.19.8,
    stage3.py) builds its first group afresh from the first (decayed) group, without the flag: the first group
    decays."""
    if "decay" in group:
        return bool(group["decay"])
    if "use_muon" in group:  # Muon's half holds matrices only, all from the decayed group; MoE renames its expert
        # groups after their expert-parallel group ("ep_size_2"), dropping "decay-"
        return bool(group["use_muon"]) or str(group.get("name", "")).startswith("decay-")
    return index == 0


def is_pipeline(engine) -> bool:
    return isinstance(engine, deepspeed.PipelineEngine)


def data_parallel_rank(engine, strategy: Strategy) -> int:
    """This rank's index among the data-parallel replicas, as DeepSpeed laid them out.

    The pipeline grid (engine.mpu for a PipelineEngine) and the AutoTP mesh (engine.mpu = deepspeed.utils.groups)
    each own their layout; the ranks of one tensor-parallel group or one pipeline share an index. DeepSpeed's
    sequence-parallel groups (engine.mpu = parallel_state_sp) are consecutive ranks and know no data-parallel rank.
    """
    if strategy.sp_size > 1:
        sp_rank, sp_size = engine.mpu.get_sequence_parallel_rank(), engine.mpu.get_sequence_parallel_world_size()
        rank, size = torch.distributed.get_rank() // sp_size, torch.distributed.get_world_size() // sp_size
        if torch.distributed.get_rank() % sp_size != sp_rank:
            raise RuntimeError(f"DeepSpeed's sequence-parallel groups are not consecutive ranks (rank {sp_rank})")
    elif engine.mpu is None:
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, size = engine.mpu.get_data_parallel_rank(), engine.mpu.get_data_parallel_world_size()
    if size != strategy.dp_size:
        raise RuntimeError(
            f"DeepSpeed built {size} data-parallel replicas, strategy.resolve expected {strategy.dp_size}"
        )
    return rank


def load_init_from(
    model: torch.nn.Module, recipe, recipe_file: str | os.PathLike, zero3: bool, ep_size: int = 1, ep_rank: int = 0
) -> None:
    """Copy the weights of ``recipe.init_from`` (a Hugging Face folder, or a dstrain run's newest checkpoint) into the
    freshly built ``model``.

    Under ZeRO-3 the model was built inside deepspeed.zero.Init, so each parameter is gathered, filled on
    rank 0 and re-partitioned from there (one parameter at a time: no rank ever holds the whole model)."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.errors import DstrainError
    from dstrain.model.hf.convert import architecture_diff

    config, state, _ = load_model_source(recipe.init_from)  # a HF folder, or a run's newest checkpoint consolidated
    differ = [f"model.{k}={ours!r} vs {theirs!r}" for k, ours, theirs in architecture_diff(recipe.model, config)]
    if differ:
        raise DstrainError(
            f"{recipe_file}: init_from {recipe.init_from} has another architecture ({'; '.join(differ)}); "
            f"set those model fields to the Hugging Face values"
        )
    if ep_size > 1:  # this rank holds its share of the experts (build_model)
        from dstrain.model.hf.experts import local_experts

        state = local_experts(state, recipe.model, ep_size, ep_rank)
    if not isinstance(model, GPT):  # a PipelineModule: this rank's stage only
        from dstrain.checkpoint.consolidate import load_into_pipeline

        load_into_pipeline(model, state, recipe.model)
        return
    if not zero3:
        model.load_state_dict(state, strict=True)
        return
    import deepspeed

    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.copy_(state[name])


@contextlib.contextmanager
def monitor_paused(engine):
    """PipelineEngine.eval_batch(reduce_output=None) hands its monitor and its loss broadcast a list, or None off
    the last stage, whenever DeepSpeed's monitor is on (DeepSpeed 0.19.8; tests/test_parallel.py::
    test_deepspeed_pipeline_eval_monitor_defect): since dstrain writes TensorBoard, CSV and W&B itself
    (dstrain.monitors), only a comet block turns it on. Our own eval record reaches the monitors through MetricsLog."""
    enabled = engine.monitor.enabled
    engine.monitor.enabled = False
    try:
        yield
    finally:
        engine.monitor.enabled = enabled
