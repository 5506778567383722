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
import dataclasses
import json
from pathlib import Path
from typing import Any

from dstrain.adapters.qlora_checks import check_quantized_layout
from dstrain.config import Recipe, run_folder
from dstrain.data.sampler import valid_micro_batches
from dstrain.errors import InputError, naming_files
from dstrain.objectives.registry import objective_of
from dstrain.precision import Precision
from dstrain.strategy import parallel
from dstrain.strategy.ds_schema import validate_ds_config
from dstrain.strategy.layouts import check_layout
from dstrain.strategy.optimizer import check_muon, fill_optimizer
from dstrain.strategy.parallel import Shape
from dstrain.strategy.resolved import OWN_SECTIONS, Strategy, offload_of, precision_of
from dstrain.strategy.tiling import check_tiling
from dstrain.strategy.topology import Topology

__all__ = ["AUTO", "Strategy", "load_ds_config", "offload_of", "precision_of", "resolve", "resolve_config"]

AUTO = "auto"
INTERVAL = "activation_checkpoint_interval"  # a pipeline's: every N layers recompute in the backward; 0 = none


def load_ds_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such ds_config file; see ds_configs/ for the shipped strategies") from None
    except OSError as e:
        raise InputError(
            f"{path}: cannot read the ds_config ({e.strerror}); pass a JSON file, e.g. ds_configs/zero1.json"
        ) from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file; pass a ds_config JSON file, e.g. ds_configs/zero1.json") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: a ds_config is a JSON object")
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
    leaves DeepSpeed's own parser (40 ms) to the caller (dstrain plan runs it on the layouts it keeps). The checks
    name the key; the file is put in front here, the strategy's check phase."""
    with naming_files(recipe=recipe_file, ds_config=ds_file):
        return resolve_config(recipe, ds_config, str(ds_file), world_size, check_device, validate)


def resolve_config(
    recipe: Recipe, ds_config: dict, source: str, world_size: int, check_device: bool = True, validate: bool = True
) -> Strategy:
    """``resolve`` for a ds_config that is no file (``source`` names it: a layout ``dstrain plan`` weighs): its
    refusals are ``InputError``s naming the key, which the caller's check phase names the file of, if any."""
    config = copy.deepcopy(ds_config)
    if "scheduler" in config:
        raise InputError("remove the 'scheduler' section; the LR schedule belongs to the recipe (schedule.*)")
    precision = _precision(config, check_device)
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise InputError(f"zero_optimization.stage={stage!r}; use 0, 1, 2 or 3")
    if precision == "bf16":
        _check_bf16_sums_in_fp32(config, stage)
    tp_size, pp_stages, sp_size, ep_size = parallel.read_sizes(config)
    model_parallel = tp_size * pp_stages * sp_size
    shape = Shape(world_size, stage, tp_size, pp_stages, sp_size, ep_size, dp_size=world_size // model_parallel)
    check_layout(config, recipe, shape, objective_of(recipe).refuses)
    check_muon(recipe, config, stage, precision, (tp_size, pp_stages, sp_size, ep_size))
    micro, grad_accum = _batch(config, recipe, world_size, shape.dp_size, pp_stages > 1 or sp_size > 1)
    check_layout(config, recipe, dataclasses.replace(shape, micro_batch=micro, grad_accum=grad_accum))
    loss_tiles, mlp_tiles = check_tiling(config, recipe, micro, sp_size, pp_stages)
    check_quantized_layout(recipe, tp_size, pp_stages, offload_of(config, "offload_param") is not None)
    _fill_recipe_values(config, recipe)
    leftover = _find_auto(config)
    if leftover:
        raise InputError(f'"auto" is not supported for {leftover}; set a value')
    if validate:
        validate_ds_config(config)  # DeepSpeed's own parser, now rather than inside deepspeed.initialize
    schedule = str(config.get("pipeline", {}).get("schedule", "1f1b")) if pp_stages > 1 else "1f1b"
    topology = Topology(world_size, stage, shape.dp_size, tp_size, pp_stages, precision, ep_size, sp_size, schedule)
    return Strategy(
        deepspeed_config={k: v for k, v in config.items() if k not in OWN_SECTIONS},
        own_sections={k: v for k, v in config.items() if k in OWN_SECTIONS},
        source=source,
        topology=topology,
        micro_batch=micro,
        grad_accum=grad_accum,
        offload_optimizer=offload_of(config, "offload_optimizer"),
        offload_param=offload_of(config, "offload_param"),
        loss_tiles=loss_tiles,
        mlp_tiles=mlp_tiles,
    )


def _fill(section: dict, key: str, value: Any, owner: str) -> None:
    """Set an experiment-owned value: "auto"/absent is filled, an equal pin is kept, a different pin is an error."""
    pinned = section.get(key, AUTO)
    if pinned != AUTO and _differs(pinned, value):
        raise InputError(
            f"pins {key}={json.dumps(pinned)} but the recipe sets {owner}={json.dumps(value)}; "
            f'the recipe owns it: set {key} to "auto"',
            also="recipe",
        )
    section[key] = value


def _batch(config: dict, recipe: Recipe, world_size: int, dp_size: int, counts_dp: bool) -> tuple[int, int]:
    """(micro-batch, accumulation steps): the ds_config's micro-batch must split the recipe's global batch."""
    micro = config.get("train_micro_batch_size_per_gpu")
    if not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0:
        raise InputError("set train_micro_batch_size_per_gpu to a positive integer (the strategy owns it)")
    global_batch = recipe.train.global_batch
    if global_batch % (micro * dp_size):
        valid = valid_micro_batches(global_batch, dp_size)
        raise InputError(
            f"train_micro_batch_size_per_gpu={micro} x data-parallel size {dp_size} does not divide "
            f"the recipe's train.global_batch={global_batch}; valid micro-batch sizes for {world_size} ranks: "
            f"{', '.join(map(str, valid)) or 'none (global batch smaller than the data-parallel size)'}"
        )
    grad_accum = global_batch // (micro * dp_size)
    _fill(config, "gradient_accumulation_steps", grad_accum, "train.global_batch")
    # DeepSpeed checks train_batch_size = micro x accumulation x the world it counts: the data-parallel
    # world for pipeline engines (their grid is passed as mpu) and under sequence parallelism (world / sp), the whole
    # world otherwise, AutoTP included.
    counted_world = dp_size if counts_dp else world_size
    _fill(config, "train_batch_size", micro * grad_accum * counted_world, "train.global_batch")
    return micro, grad_accum


def _fill_recipe_values(config: dict, recipe: Recipe) -> None:
    """Clipping, the optimizer's hyper-parameters and the seed come from the recipe; monitors write into run_dir."""
    _fill(config, "gradient_clipping", recipe.optim.grad_clip, "optim.grad_clip")
    fill_optimizer(config, recipe, _fill)
    config.setdefault("steps_per_print", 10**9)  # the loop prints its own progress line
    _fill(config, "seed", recipe.seed, "seed")  # a record only: DeepSpeed does not read it
    _fill_monitor_paths(config, recipe)


def _precision(config: dict, check_device: bool) -> Precision:
    fp16 = config.get("fp16", {}).get("enabled", False)
    bf16 = config.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise InputError("enable one of fp16 and bf16, not both")
    if fp16:
        from deepspeed.accelerator import get_accelerator

        if check_device and not get_accelerator().is_fp16_supported():
            raise InputError(
                f"fp16 is not supported on this device ({get_accelerator().device_name()}); "
                f"use a bf16 config such as ds_configs/zero1_bf16.json, or an fp32 one"
            )
        if config.get("zero_optimization", {}).get("stage", 0) == 0:
            # DeepSpeed 0.19.8 defect: engine.backward() scales the loss only for ZeRO optimizers, while
            # FP16_Optimizer.step() still unscales the gradients, so ZeRO-0 fp16 updates come out ~scale x too
            # small and overflow is never detected (upstream PR "Fix FP16 ZeRO Stage 0 loss scaling in
            # engine.backward()"). tests/test_fp16.py::test_deepspeed_zero0_fp16_defect_is_still_there fails when it
            # is fixed.
            raise InputError(
                "fp16 with ZeRO stage 0 trains silently wrong in DeepSpeed 0.19 (unscaled loss); "
                "use ds_configs/zero1_fp16.json"
            )
    return precision_of(config)


def _check_bf16_sums_in_fp32(config: dict, stage: int) -> None:
    """bf16 gradients are summed in fp32, across micro-batches and across ranks, or the run is refused.

    DeepSpeed 0.19.8 sums both in the model dtype unless told otherwise: measured with 16 micro-batches, the
    accumulated gradient is 4e-3 (relative) from the exact sum, 2.5 bf16 roundings; with the two keys below,
    2e-9 (tests/test_precision.py). ZeRO-1 then runs BF16_Optimizer (fp32 accumulation buffer), ZeRO-2/3 keep
    fp32 gradient partitions. At stage 0 DeepSpeed cannot accumulate bf16 in fp32 (NotImplementedError).
    """
    if stage == 0 and int(config.get("pipeline", {}).get("stages", 1)) == 1:
        raise InputError(
            "bf16 with ZeRO stage 0 sums gradients in bf16 (DeepSpeed 0.19.8 cannot accumulate them in "
            "fp32 there); use ds_configs/zero1_bf16.json, the same math with less memory"
        )
    if stage > 0 and config.get("data_types", {}).get("grad_accum_dtype") != "fp32":
        raise InputError('bf16 gradients would be accumulated in bf16; add "data_types": {"grad_accum_dtype": "fp32"}')
    if config.get("communication_data_type") != "fp32":
        raise InputError('bf16 gradients would be reduced across ranks in bf16; add "communication_data_type": "fp32"')


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
