"""Checkpoints as the plain GPT's state dict, whatever strategy wrote them, and back into pipeline stages.

    config, state = read_checkpoint("runs/tiny")       # newest complete tag of a run (or a checkpoints/ or tag folder)
    GPT(config).load_state_dict(state)                  # evaluate, export (model.hf.convert.to_hf), a plain run
    load_into_pipeline(pipeline_module, state, config)  # the same weights in a PipelineModule's local stages

Layouts DeepSpeed writes in a tag folder:
  plain, ZeRO-0/1/2   mp_rank_00_model_states.pt holds the whole model under "module"
  pipeline            layer_XX-model_states.pt, one per pipeline layer (dstrain.model.pipe.layer_prefixes)
  AutoTP              mp_rank_XX_model_states.pt, one per tensor-parallel rank; a column-parallel weight (and its
                      bias) is split on dim 0, a row-parallel weight on dim 1, everything else is replicated
  ZeRO-3              the weights live in the optimizer partitions: use the zero_to_fp32.py DeepSpeed leaves there

Weights only, as saved: a bf16 run's layer files / TP shards hold bf16 weights (the fp32 masters stay in the
optimizer partitions). `dstrain export` (dstrain.commands.export) writes the result as a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import torch

from dstrain.checkpoint import nvme, reshard, safe_load
from dstrain.checkpoint.ds_files import (
    EXPERT_FILES,
    LAYER_FILE,
    MP_RANK_FILE,
    PIPE_LAYER_FILES,
    TP_RANK1_MODEL_FILE,
    ZERO_MODEL_FILES,
    ZERO_OPTIM_FILES,
)
from dstrain.checkpoint.store import check_loadable, damage, newest_intact_other_than, published_tags
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT, StateDict
from dstrain.model.pipe import TIED_KEY, layer_prefixes
from dstrain.run_dir import LATEST, RunDir
from dstrain.typed_yaml import parse

# --- pipeline layers <-> plain names ---


def pipeline_to_plain(layers: dict[int, StateDict], config: GPTConfig) -> StateDict:
    """{pipeline layer index: its state dict} -> GPT(config).state_dict() names."""
    state = {}
    for index, prefixes in enumerate(layer_prefixes(config)):
        if prefixes is None:
            continue
        plain, own = prefixes
        if index not in layers:
            raise DstrainError(f"pipeline layer {index} ({plain}*) is missing from the checkpoint")
        state.update({plain + key[len(own) :]: value for key, value in layers[index].items()})
    if config.tied:
        state["lm_head.weight"] = state["embed.tok.weight"]
    return state


def plain_to_pipeline(state: StateDict, config: GPTConfig) -> dict[int, StateDict]:
    """GPT(config).state_dict() -> {pipeline layer index: state dict}; a tied head's layer has none."""
    layers = {}
    for index, prefixes in enumerate(layer_prefixes(config)):
        if prefixes is not None:
            plain, own = prefixes
            layers[index] = {own + key[len(plain) :]: value for key, value in state.items() if key.startswith(plain)}
    return layers


def load_into_pipeline(module, state: StateDict, config: GPTConfig) -> None:
    """Load a plain state dict into the layers this rank's PipelineModule holds (its stage), tied copies included."""
    layers = plain_to_pipeline(state, config)
    for offset, layer in enumerate(module.forward_funcs):
        index = module._local_start + offset
        if isinstance(layer, torch.nn.Module) and index in layers:
            layer.load_state_dict(layers[index])
    if TIED_KEY in module.tied_modules:  # the embedding, also on the stage that only uses it as the head
        module.tied_modules[TIED_KEY].load_state_dict(layers[0])


# --- tensor-parallel shards -> whole tensors ---


def consolidate_tensor_parallel(shards: list[StateDict], tensor_parallel: dict) -> StateDict:
    """Shards in tensor-parallel rank order -> whole tensors, split as the ds_config's tensor_parallel section says
    (its partition_config and/or preset_model, read by DeepSpeed's own parser)."""
    from deepspeed.module_inject.autotp_config import PartitionType
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    specs = TPTrainingConfig(**tensor_parallel).get_partition_config_object()
    state = {}
    for name, first in shards[0].items():
        module, _, kind = name.rpartition(".")
        spec = specs.find_matching_spec(f"{module}.weight")
        pieces = [shard[name] for shard in shards]
        if (
            spec is None
            or spec.partition_type == PartitionType.SKIP
            or (spec.partition_type == PartitionType.ROW and kind == "bias")
        ):
            state[name] = first  # replicated (a row-parallel bias is added once, after the all-reduce)
        elif spec.shape is not None:
            raise DstrainError(f"{name}: consolidating fused AutoTP weights (a layer_spec 'shape') is not supported")
        else:
            dim = 0 if kind == "bias" else spec.get_partition_dim()
            state[name] = torch.cat(pieces, dim=dim)
    return state


# --- checkpoint folders ---


def tag_folder(path: str | Path) -> Path:
    """A tag folder from a run folder, a checkpoints/ folder (its `latest`) or the tag folder itself."""
    path = Path(path)
    for folder in (RunDir(path).checkpoints, path):
        if (folder / LATEST).is_file():
            return folder / (folder / LATEST).read_text().strip()
    if not path.is_dir():
        raise DstrainError(f"{path}: no such checkpoint; name a run folder, its checkpoints/ or one global_step* in it")
    return path


def read_checkpoint(path: str | Path) -> tuple[GPTConfig, StateDict]:
    """The model config and plain GPT state dict of a checkpoint written by any dstrain strategy."""
    tag = tag_folder(path)
    ranks = sorted((int(m.group(1)), p) for p in tag.iterdir() if (m := MP_RANK_FILE.match(p.name)))
    if not ranks:
        if any(tag.glob(ZERO_MODEL_FILES)):
            raise DstrainError(f"{tag} is a ZeRO-3 checkpoint; consolidate it with {tag.parent / 'zero_to_fp32.py'}")
        raise DstrainError(f"{tag}: no DeepSpeed model states in it; name a run folder or a global_step* folder")
    first = safe_load.load(ranks[0][1])
    if "recipe" not in first:
        raise DstrainError(f"{ranks[0][1]}: not written by dstrain (no recipe in its client state)")
    config = parse(GPTConfig, first["recipe"]["model"], ranks[0][1], "model.")  # MoEConfig nested too
    layer_files = {int(m.group(1)): p for p in tag.iterdir() if (m := LAYER_FILE.match(p.name))}
    if layer_files:
        layers = {i: safe_load.load(p) for i, p in layer_files.items()}
        return config, pipeline_to_plain(layers, config)
    if len(ranks) == 1:
        return config, first["module"]
    shards = [first["module"]] + [safe_load.load(p)["module"] for _, p in ranks[1:]]
    tensor_parallel = first["ds_config"].get("tensor_parallel")
    if not tensor_parallel:
        raise DstrainError(f"{tag}: {len(ranks)} model-parallel shards but no tensor_parallel section in its ds_config")
    return config, consolidate_tensor_parallel(shards, tensor_parallel)


# --- reading: a tag of any strategy as one plain state dict --------------------------------------------------------


def load_run(run_dir: str | os.PathLike, tag: str | None):
    """(recipe, tag folder) of a run directory; tag None = the newest complete checkpoint."""
    from dstrain.recipe_file import load_recipe

    files = RunDir.find(run_dir)
    if files is None:
        raise DstrainError(
            f"{RunDir(Path(run_dir)).recipe}: no such file; pass a run directory written by dstrain.train"
        )
    recipe = load_recipe(files.recipe)
    checkpoints = files.checkpoints
    if tag is None:  # the tag `latest` names, else the newest saved; damaged, it is refused below
        tags = published_tags(checkpoints)
        latest = files.latest.read_text().strip() if files.latest.is_file() else None
        tag = latest if latest in tags else (tags[-1] if tags else None)
    if tag is None:
        raise DstrainError(f"{checkpoints}: no complete checkpoint; train the run first or pass --tag")
    if not (checkpoints / tag).is_dir():
        raise DstrainError(f"--tag {tag}: no checkpoint {checkpoints / tag}; omit --tag for the newest")
    if problem := damage(checkpoints / tag):
        intact = newest_intact_other_than(checkpoints, tag)
        fix = f"pass --tag {intact} (intact)" if intact else "no other checkpoint of this run is intact"
        raise DstrainError(f"{checkpoints / tag} is damaged: {problem}; {fix}")
    check_loadable(checkpoints / tag)
    return recipe, checkpoints / tag


def weights_kind(tag_dir: Path) -> str:
    """ "fp32 master" for a bf16 run, whose checkpoint keeps them apart from its bf16 module weights (ZeRO and fp16
    runs read through zero_to_fp32 get their masters too), else "module"."""
    saved = reshard.saved(tag_dir)
    if any(tag_dir.glob(EXPERT_FILES)):  # MoE: the masters sit in expert-data-parallel partitions; the module's own
        return "module"
    return "fp32 master" if saved and saved.precision == "bf16" else "module"


def consolidated_state_dict(tag_dir: Path, model_config: GPTConfig) -> dict[str, torch.Tensor]:
    """fp32 weights of GPT(model_config), from a checkpoint of any strategy: the fp32 masters of a bf16 run (its
    module weights are a rounding of them), otherwise the module's own, widened to fp32."""
    if nvme.is_nvme_checkpoint(tag_dir):  # ZeRO-3 with its masters partly in swap files: fp32 masters either way
        return {name: tensor.float().contiguous() for name, tensor in module_state_dict(tag_dir).items()}
    if weights_kind(tag_dir) == "fp32 master":
        state = reshard.fp32_masters(tag_dir, model_config)
        with torch.device("meta"):
            missing = GPT(model_config).state_dict().keys() - state.keys()
        if missing:  # frozen parameters (a lora: run's base) have no master: the module's own weights, never moved
            # (under ZeRO-3 in the model states' partitions, which zero_to_fp32 joins)
            module = zero_to_fp32(tag_dir) if any(tag_dir.glob(ZERO_MODEL_FILES)) else module_state_dict(tag_dir)
            state |= {name: module[name].float().contiguous() for name in missing}
        return state
    return {name: tensor.float().contiguous() for name, tensor in module_state_dict(tag_dir).items()}


def module_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The module's weights in the checkpoint, in the model's dtype (fp32 masters for ZeRO, read by zero_to_fp32)."""
    if any(tag_dir.glob(EXPERT_FILES)):
        # DeepSpeed's MoE checkpoint: the dense weights, then one file per expert named by its global index.
        state = reshard.read_pt(tag_dir / reshard.ZERO12_MODEL_FILE)["module"]
        for path in sorted(tag_dir.glob(EXPERT_FILES)):
            state.update(safe_load.load(path))
        return state
    if any(tag_dir.glob(PIPE_LAYER_FILES)) or any(tag_dir.glob(TP_RANK1_MODEL_FILE)):
        # Pipeline layer files / AutoTP shards: read_checkpoint consolidates them into the plain model.
        return read_checkpoint(tag_dir)[1]
    if any(tag_dir.glob(ZERO_OPTIM_FILES)):  # ZeRO-1/2/3 partitions
        return with_zero1_frozen_parameters(zero_to_fp32(tag_dir), tag_dir)
    return reshard.read_pt(tag_dir / reshard.ZERO12_MODEL_FILE)["module"]  # ZeRO-0 and BF16_Optimizer: the whole model


def zero_to_fp32(tag_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation of ZeRO partitions (its torch.load calls go through safe_load); its progress
    prints would land in `dstrain generate`'s output. It reads only the optim_states files, which under NVMe offload
    lack the swapped masters: it reads a copy with them put back."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet, tempfile.TemporaryDirectory(prefix="dstrain-nvme-") as tmp, safe_load.only_weights():
        folder = nvme.spliced_copy(tag_dir, Path(tmp)) if nvme.is_nvme_checkpoint(tag_dir) else tag_dir
        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)


def with_zero1_frozen_parameters(state: dict[str, torch.Tensor], tag_dir: Path) -> dict[str, torch.Tensor]:
    """zero_to_fp32's state dict with the frozen parameters (a lora: run's base) of a ZeRO-1 checkpoint put back.

    DeepSpeed 0.19.8 records frozen parameters for zero_to_fp32 (frozen_param_shapes) only from ZeRO-2 on
    (engine._save_checkpoint: save_frozen_param = zero_optimization_partition_gradients()), and zero_to_fp32 then
    leaves them out of a ZeRO-1 checkpoint without a word. The model states file holds them whole there (under
    ZeRO-3 it holds empty placeholders, and zero_to_fp32 has them). tests/test_lora_strategies.py::
    test_deepspeed_drops_zero1_frozen_parameters notices a fix upstream."""
    model_file = tag_dir / reshard.ZERO12_MODEL_FILE
    if not model_file.is_file():  # ZeRO-3: one model states file per rank, and zero_to_fp32 has the frozen ones
        return state
    module = reshard.read_pt(model_file)["module"]
    return state | {name: t.float() for name, t in module.items() if name not in state and t.numel() > 0}


# --- a model to evaluate or sample from: a run's checkpoint or a Hugging Face folder ---


def load_model_source(path: str | os.PathLike, tag: str | None = None):
    """(GPTConfig, fp32 state dict, the run's recipe or None) of a run directory or a Hugging Face model folder."""
    from dstrain.model.hf.convert import from_hf

    path = Path(path)
    if (path / "config.json").is_file():
        if tag:
            raise DstrainError(f"--tag {tag}: {path} is a Hugging Face model folder, which has no checkpoints")
        config, state = from_hf(path)
        return config, {k: v.float() for k, v in state.items()}, None
    if RunDir.find(path):
        recipe, tag_dir = load_run(path, tag)
        state = consolidated_state_dict(tag_dir, recipe.model)
        if recipe.lora is not None:  # a lora: run as one model: each adapter folded into its weight
            from dstrain.adapters.lora import merged_state_dict

            state = merged_state_dict(state, recipe.model, recipe.lora)
        return recipe.model, state, recipe
    raise DstrainError(f"{path}: neither a run directory (recipe.yaml) nor a Hugging Face model folder (config.json)")
