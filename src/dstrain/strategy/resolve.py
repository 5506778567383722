"""The strategy: a ds_config resolved against a recipe and a world size.

A ds_config (DeepSpeed's own JSON schema) says how a run executes: ZeRO stage,
precision, micro-batch, offload, optimizer implementation, parallelism. Values
the experiment owns appear as ``"auto"`` and are filled from the recipe here, in
one place; a ds_config that pins a different value is an error, never a silent
override. Parallel sizes and gradient accumulation are derived here too:

    data-parallel size  = world size / (tensor-parallel size x pipeline stages x sequence-parallel size)
    expert-data-parallel size = data-parallel size / expert-parallel size  (replicas of each expert)
    accumulation steps  = global batch / (micro-batch x data-parallel size)
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain.config import Recipe, run_folder
from dstrain.data.sampler import valid_micro_batches
from dstrain.errors import DstrainError
from dstrain.precision import Precision
from dstrain.strategy import parallel
from dstrain.strategy.ds_schema import validate_ds_config
from dstrain.strategy.optimizer import check_muon, fill_optimizer
from dstrain.strategy.tiling import check_tiling
from dstrain.strategy.topology import Topology

AUTO = "auto"
INTERVAL = "activation_checkpoint_interval"  # a pipeline's: every N layers recompute in the backward; 0 = none


def precision_of(ds_config: dict) -> Precision:
    """ "fp16", "bf16" or "fp32", as DeepSpeed reads a ds_config's switches (resolve also checks them)."""
    if ds_config.get("fp16", {}).get("enabled", False):
        return "fp16"
    return "bf16" if ds_config.get("bf16", {}).get("enabled", False) else "fp32"


def offload_of(ds_config: dict, key: str) -> str | None:
    """Where zero_optimization.<key> ("offload_optimizer" / "offload_param") puts its state: "cpu", "nvme" or None."""
    device = ds_config.get("zero_optimization", {}).get(key, {}).get("device", "none")
    return None if device == "none" else device


@dataclass(frozen=True)
class Strategy:
    ds_config: dict  # complete, with no "auto" left: what deepspeed.initialize receives
    source: str  # the ds_config file it came from
    topology: Topology  # ZeRO stage, precision, parallel sizes (ds_config "tensor_parallel.autotp_size",
    # "pipeline.stages", "expert_parallel.autoep_size", "sequence_parallel_size"; data-parallel: what is left)
    micro_batch: int  # samples per rank per forward/backward
    grad_accum: int  # micro-batches per optimizer step on each rank
    offload_optimizer: str | None  # "cpu", "nvme" or None
    offload_param: str | None
    # the loss in this many sequence tiles of each rank's slice (ds_config "tiling.loss", "auto" when absent:
    # dstrain.strategy.tiling); Range: 1 (off) .. seq_len / sp, a divisor
    loss_tiles: int = 1
    mlp_tiles: int = 1  # each MLP in this many sequence tiles (ds_config "tiling.mlp"); Range: 1 (off), a divisor

    @property
    def name(self) -> str:
        return Path(self.source).stem

    def ep_rank(self, rank: int) -> int:
        """The index of global `rank` in its expert-parallel group: DeepSpeed groups consecutive ranks
        (deepspeed.utils.groups._create_expert_and_data_parallel, data-before-expert-parallel off)."""
        return rank % self.ep_size

    # The topology's fields, read through the strategy.
    @property
    def zero_stage(self) -> int:
        return self.topology.zero_stage

    @property
    def precision(self) -> Precision:
        return self.topology.precision

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    @property
    def pp_stages(self) -> int:
        return self.topology.pp_stages

    @property
    def ep_size(self) -> int:
        return self.topology.ep_size

    @property
    def sp_size(self) -> int:
        return self.topology.sp_size

    @property
    def zero_partitions(self) -> int:
        """Ranks ZeRO partitions the model states over: the data-parallel replicas, and under sequence parallelism
        their SP ranks too (DeepSpeed's sequence-data-parallel group)."""
        return self.dp_size * self.sp_size

    @property
    def pipe_schedule(self) -> str:
        return self.topology.pipe_schedule

    @property
    def pipe_checkpoint_interval(self) -> int:
        """A pipeline's activation_checkpoint_interval as given (0: none), else 1 where the ds_config has an
        activation_checkpointing section (every block, as for the plain model); the two together are refused."""
        return self.ds_config.get("pipeline", {}).get(INTERVAL, int("activation_checkpointing" in self.ds_config))

    @property
    def activation_checkpointing(self) -> bool:
        """Blocks recompute their activations in the backward: the ds_config's activation_checkpointing section,
        or a pipeline's activation_checkpoint_interval."""
        return "activation_checkpointing" in self.ds_config or (
            self.pp_stages > 1 and self.pipe_checkpoint_interval > 0
        )

    @property
    def host_checkpoints(self) -> bool:
        """Each checkpointed block input is held in host memory (activation_checkpointing.cpu_checkpointing:
        dstrain.train.engine.host_checkpoints)."""
        return bool(self.ds_config.get("activation_checkpointing", {}).get("cpu_checkpointing", False))


def load_ds_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise DstrainError(f"{path}: no such ds_config file; see ds_configs/ for the shipped strategies") from None
    except OSError as e:
        raise DstrainError(
            f"{path}: cannot read the ds_config ({e.strerror}); pass a JSON file, e.g. ds_configs/zero1.json"
        ) from None
    except UnicodeDecodeError:
        raise DstrainError(f"{path}: not a text file; pass a ds_config JSON file, e.g. ds_configs/zero1.json") from None
    except json.JSONDecodeError as e:
        raise DstrainError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise DstrainError(f"{path}: a ds_config is a JSON object")
    return config


def resolve(
    recipe: Recipe,
    recipe_file: str | Path,
    ds_config: dict,
    ds_file: str | Path,
    world_size: int,
    check_device: bool = True,
    validate: bool = True,
) -> Strategy:
    """Fill every "auto" from the recipe and check the ds_config against it; ``check_device=False`` when
    resolving for another machine (an estimate for a GPU cluster, made on a CPU login node); ``validate=False``
    leaves DeepSpeed's own parser (40 ms) to the caller (dstrain plan runs it on the layouts it keeps)."""
    config = copy.deepcopy(ds_config)
    ds_file, recipe_file = str(ds_file), str(recipe_file)
    if "scheduler" in config:
        raise DstrainError(
            f"{ds_file}: remove the 'scheduler' section; the LR schedule belongs to the recipe (schedule.*)"
        )
    precision = _precision(config, ds_file, check_device)
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DstrainError(f"{ds_file}: zero_optimization.stage={stage!r}; use 0, 1, 2 or 3")
    if precision == "bf16":
        _check_bf16_sums_in_fp32(config, ds_file, stage)
    tp_size, pp_stages, sp_size, dp_size = _parallel_sizes(config, recipe, recipe_file, ds_file, world_size)
    ep_size = parallel.check_expert_parallel(config, recipe, recipe_file, ds_file, dp_size, pp_stages, tp_size, sp_size)
    check_muon(recipe, config, ds_file, stage, precision, (tp_size, pp_stages, sp_size, ep_size))
    micro, grad_accum = _batch(config, recipe, recipe_file, ds_file, world_size, dp_size, pp_stages > 1 or sp_size > 1)
    parallel.check_pipeline_accumulation(config, ds_file, pp_stages, grad_accum)
    loss_tiles, mlp_tiles = check_tiling(config, recipe, ds_file, micro, sp_size, pp_stages)
    _check_host_checkpoints(config, ds_file, pp_stages)
    _fill_recipe_values(config, recipe, recipe_file, ds_file)
    leftover = _find_auto(config)
    if leftover:
        raise DstrainError(f'{ds_file}: "auto" is not supported for {leftover}; set a value')
    if validate:
        validate_ds_config(config, ds_file)  # DeepSpeed's own parser, now rather than inside deepspeed.initialize
    schedule = str(config.get("pipeline", {}).get("schedule", "1f1b")) if pp_stages > 1 else "1f1b"
    topology = Topology(world_size, stage, dp_size, tp_size, pp_stages, precision, ep_size, sp_size, schedule)
    return Strategy(
        ds_config=config,
        source=ds_file,
        topology=topology,
        micro_batch=micro,
        grad_accum=grad_accum,
        offload_optimizer=offload_of(config, "offload_optimizer"),
        offload_param=offload_of(config, "offload_param"),
        loss_tiles=loss_tiles,
        mlp_tiles=mlp_tiles,
    )


def _check_host_checkpoints(config: dict, ds_file: str, pp_stages: int) -> None:
    """activation_checkpointing.cpu_checkpointing holds checkpoints on the host: there must be checkpoints."""
    host = config.get("activation_checkpointing", {}).get("cpu_checkpointing", False)
    if not isinstance(host, bool):
        raise DstrainError(f"{ds_file}: activation_checkpointing.cpu_checkpointing={host!r}; use true or false")
    if host and pp_stages > 1 and config["pipeline"].get("activation_checkpoint_interval", None) == 0:
        raise DstrainError(
            f"{ds_file}: activation_checkpointing.cpu_checkpointing holds activation checkpoints on the host, but "
            f"pipeline.activation_checkpoint_interval=0 turns activation checkpointing off; set the interval to 1 or "
            f"cpu_checkpointing to false"
        )
    if pp_stages > 1 and "activation_checkpointing" in config and config["pipeline"].get(INTERVAL) == 0:
        raise DstrainError(  # an explicit 0 is a value: neither it nor the section is overruled in silence
            f"{ds_file}: the activation_checkpointing section recomputes the blocks, but pipeline.{INTERVAL}=0 turns "
            f"activation checkpointing off; remove the interval (every block is checkpointed) or the section"
        )


def _fill(section: dict, key: str, value: Any, owner: str, ds_file: str, recipe_file: str) -> None:
    """Set an experiment-owned value: "auto"/absent is filled, an equal pin is kept, a different pin is an error."""
    pinned = section.get(key, AUTO)
    if pinned != AUTO and _differs(pinned, value):
        raise DstrainError(
            f"{ds_file} pins {key}={json.dumps(pinned)} but {recipe_file} sets {owner}={json.dumps(value)}; "
            f'the recipe owns it: set {key} to "auto" in {ds_file}'
        )
    section[key] = value


def _parallel_sizes(
    config: dict, recipe: Recipe, recipe_file: str, ds_file: str, world_size: int
) -> tuple[int, int, int, int]:
    """(tensor-parallel size, pipeline stages, sequence-parallel size, data-parallel size), each checked against the
    model and the world."""
    stage = config["zero_optimization"].get("stage", 0)
    tp_size = int(config.get("tensor_parallel", {}).get("autotp_size", 1))
    pp_stages = int(config.get("pipeline", {}).get("stages", 1))
    sp_size = parallel.check_sequence_parallel(config, recipe, recipe_file, ds_file, tp_size, pp_stages)
    model_parallel = tp_size * pp_stages * sp_size
    if world_size % model_parallel:
        raise DstrainError(
            f"{ds_file}: world size {world_size} is not divisible by tensor-parallel {tp_size} x pipeline {pp_stages} "
            f"x sequence-parallel {sp_size}; launch a multiple of {model_parallel} ranks"
        )
    if pp_stages > 1 and stage > 1:
        raise DstrainError(
            f"{ds_file}: pipeline parallelism works with ZeRO stage 0 or 1, not {stage}; "
            f"set zero_optimization.stage to 1"
        )
    if pp_stages > 1 and recipe.preference is not None:  # the last stage would need the pairs' reference scores
        raise DstrainError(
            f"{ds_file}: pipeline parallelism does not run a recipe's preference: section (docs/preference-tuning.md);"
            f" use a ZeRO, AutoTP or sequence-parallel ds_config"
        )
    if pp_stages > 1:
        parallel.check_pipeline(config["pipeline"], ds_file, recipe.model.n_layer, recipe_file)
    if tp_size > 1:
        parallel.check_tensor_parallel(config["tensor_parallel"], recipe, recipe_file, ds_file, pp_stages)
    return tp_size, pp_stages, sp_size, world_size // model_parallel


def _batch(
    config: dict, recipe: Recipe, recipe_file: str, ds_file: str, world_size: int, dp_size: int, counts_dp: bool
) -> tuple[int, int]:
    """(micro-batch, accumulation steps): the ds_config's micro-batch must split the recipe's global batch."""
    micro = config.get("train_micro_batch_size_per_gpu")
    if not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0:
        raise DstrainError(
            f"{ds_file}: set train_micro_batch_size_per_gpu to a positive integer (the strategy owns it)"
        )
    global_batch = recipe.train.global_batch
    if global_batch % (micro * dp_size):
        valid = valid_micro_batches(global_batch, dp_size)
        raise DstrainError(
            f"{ds_file}: train_micro_batch_size_per_gpu={micro} x data-parallel size {dp_size} does not divide "
            f"train.global_batch={global_batch} of {recipe_file}; valid micro-batch sizes for {world_size} ranks: "
            f"{', '.join(map(str, valid)) or 'none (global batch smaller than the data-parallel size)'}"
        )
    grad_accum = global_batch // (micro * dp_size)
    _fill(config, "gradient_accumulation_steps", grad_accum, "train.global_batch", ds_file, recipe_file)
    # DeepSpeed checks train_batch_size = micro x accumulation x the world it counts: the data-parallel
    # world for pipeline engines (their grid is passed as mpu) and under sequence parallelism (world / sp), the whole
    # world otherwise, AutoTP included.
    counted_world = dp_size if counts_dp else world_size
    _fill(config, "train_batch_size", micro * grad_accum * counted_world, "train.global_batch", ds_file, recipe_file)
    return micro, grad_accum


def _fill_recipe_values(config: dict, recipe: Recipe, recipe_file: str, ds_file: str) -> None:
    """Clipping, the optimizer's hyper-parameters and the seed come from the recipe; monitors write into run_dir."""
    o = recipe.optim
    _fill(config, "gradient_clipping", o.grad_clip, "optim.grad_clip", ds_file, recipe_file)
    fill_optimizer(
        config,
        recipe,
        recipe_file,
        ds_file,
        lambda section, key, value, owner: _fill(section, key, value, owner, ds_file, recipe_file),
    )
    config.setdefault("steps_per_print", 10**9)  # the loop prints its own progress line
    _fill(config, "seed", recipe.seed, "seed", ds_file, recipe_file)  # a record only: DeepSpeed does not read it
    _fill_monitor_paths(config, recipe)


def _precision(config: dict, ds_file: str, check_device: bool) -> Precision:
    fp16 = config.get("fp16", {}).get("enabled", False)
    bf16 = config.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise DstrainError(f"{ds_file}: enable one of fp16 and bf16, not both")
    if fp16:
        from deepspeed.accelerator import get_accelerator

        if check_device and not get_accelerator().is_fp16_supported():
            raise DstrainError(
                f"{ds_file}: fp16 is not supported on this device ({get_accelerator().device_name()}); "
                f"use a bf16 config such as ds_configs/zero1_bf16.json, or an fp32 one"
            )
        if config.get("zero_optimization", {}).get("stage", 0) == 0:
            # DeepSpeed 0.19.8 defect: engine.backward() scales the loss only for ZeRO optimizers, while
            # FP16_Optimizer.step() still unscales the gradients, so ZeRO-0 fp16 updates come out ~scale x too
            # small and overflow is never detected (upstream PR "Fix FP16 ZeRO Stage 0 loss scaling in
            # engine.backward()"). tests/test_fp16.py::test_deepspeed_zero0_fp16_defect_is_still_there fails when it
            # is fixed.
            raise DstrainError(
                f"{ds_file}: fp16 with ZeRO stage 0 trains silently wrong in DeepSpeed 0.19 (unscaled loss); "
                f"use ds_configs/zero1_fp16.json"
            )
    return precision_of(config)


def _check_bf16_sums_in_fp32(config: dict, ds_file: str, stage: int) -> None:
    """bf16 gradients are summed in fp32, across micro-batches and across ranks, or the run is refused.

    DeepSpeed 0.19.8 sums both in the model dtype unless told otherwise: measured with 16 micro-batches, the
    accumulated gradient is 4e-3 (relative) from the exact sum, 2.5 bf16 roundings; with the two keys below,
    2e-9 (tests/test_precision.py). ZeRO-1 then runs BF16_Optimizer (fp32 accumulation buffer), ZeRO-2/3 keep
    fp32 gradient partitions. At stage 0 DeepSpeed cannot accumulate bf16 in fp32 (NotImplementedError).
    """
    if stage == 0 and int(config.get("pipeline", {}).get("stages", 1)) == 1:
        raise DstrainError(
            f"{ds_file}: bf16 with ZeRO stage 0 sums gradients in bf16 (DeepSpeed 0.19.8 cannot accumulate them in "
            f"fp32 there); use ds_configs/zero1_bf16.json, the same math with less memory"
        )
    if stage > 0 and config.get("data_types", {}).get("grad_accum_dtype") != "fp32":
        raise DstrainError(
            f'{ds_file}: bf16 gradients would be accumulated in bf16; add "data_types": {{"grad_accum_dtype": "fp32"}}'
        )
    if config.get("communication_data_type") != "fp32":
        raise DstrainError(
            f'{ds_file}: bf16 gradients would be reduced across ranks in bf16; add "communication_data_type": "fp32"'
        )


def _fill_monitor_paths(config: dict, recipe: Recipe) -> None:
    """The TensorBoard and CSV monitors write into the run folder, in a folder named after the recipe, unless the
    ds_config says otherwise (DeepSpeed's output_path / job_name). DeepSpeed's wandb block has neither: its project,
    team and group default to W&B's environment variables (dstrain.monitors.settings)."""
    for block, folder in [("tensorboard", "tensorboard"), ("csv_monitor", "csv")]:
        section = config.get(block)
        if not isinstance(section, dict) or not section.get("enabled"):
            continue
        if section.get("output_path", AUTO) == AUTO:
            section["output_path"] = str(run_folder(recipe) / folder)
        if section.get("job_name", AUTO) == AUTO:
            section["job_name"] = recipe.name


def _differs(pinned: Any, value: Any) -> bool:
    if isinstance(value, (int, float)) and isinstance(pinned, (int, float)):
        return abs(pinned - value) > 1e-12 * max(1.0, abs(value))
    if isinstance(value, list) and isinstance(pinned, list):
        return len(pinned) != len(value) or any(_differs(p, v) for p, v in zip(pinned, value))
    return pinned != value


def _find_auto(node: Any, path: str = "") -> str | None:
    if node == AUTO:
        return path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        found = _find_auto(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None
