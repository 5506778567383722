"""Checkpoints as the plain GPT's state dict, whatever strategy wrote them, and back into pipeline stages.

    config, state = read_checkpoint("runs/tiny")       # newest complete tag of a run (or a checkpoints/ or tag folder)
    GPT(config).load_state_dict(state)                  # evaluate, export (dstrain.model.hf.to_hf), start a plain run
    load_into_pipeline(pipeline_module, state, config)  # the same weights in a PipelineModule's local stages

Layouts DeepSpeed writes in a tag folder:
  plain, ZeRO-0/1/2   mp_rank_00_model_states.pt holds the whole model under "module"
  pipeline            layer_XX-model_states.pt, one per pipeline layer (dstrain.model.pipe.layer_prefixes)
  AutoTP              mp_rank_XX_model_states.pt, one per tensor-parallel rank; a column-parallel weight (and its
                      bias) is split on dim 0, a row-parallel weight on dim 1, everything else is replicated
  ZeRO-3              the weights live in the optimizer partitions: use the zero_to_fp32.py DeepSpeed leaves there

Weights only, as saved: a bf16 run's layer files / TP shards hold bf16 weights (the fp32 masters stay in the
optimizer partitions). `dstrain export` (dstrain.export) writes the result as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import StateDict
from dstrain.model.pipe import TIED_KEY, layer_prefixes

LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")
MP_RANK_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


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
    for folder in (path / "checkpoints", path):
        if (folder / "latest").is_file():
            return folder / (folder / "latest").read_text().strip()
    if not path.is_dir():
        raise DstrainError(f"{path}: no such checkpoint; name a run folder, its checkpoints/ or one global_step* in it")
    return path


def read_checkpoint(path: str | Path) -> tuple[GPTConfig, StateDict]:
    """The model config and plain GPT state dict of a checkpoint written by any dstrain strategy."""
    tag = tag_folder(path)
    ranks = sorted((int(m.group(1)), p) for p in tag.iterdir() if (m := MP_RANK_FILE.match(p.name)))
    if not ranks:
        if any(tag.glob("zero_pp_rank_*_model_states.pt")):
            raise DstrainError(f"{tag} is a ZeRO-3 checkpoint; consolidate it with {tag.parent / 'zero_to_fp32.py'}")
        raise DstrainError(f"{tag}: no DeepSpeed model states in it; name a run folder or a global_step* folder")
    first = torch.load(ranks[0][1], map_location="cpu", weights_only=False)
    if "recipe" not in first:
        raise DstrainError(f"{ranks[0][1]}: not written by dstrain (no recipe in its client state)")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}  # checkpoints from before 0.2 also hold
    config = GPTConfig(**{k: v for k, v in first["recipe"]["model"].items() if k in fields})  # activation_checkpointing
    layer_files = {int(m.group(1)): p for p in tag.iterdir() if (m := LAYER_FILE.match(p.name))}
    if layer_files:
        layers = {i: torch.load(p, map_location="cpu", weights_only=True) for i, p in layer_files.items()}
        return config, pipeline_to_plain(layers, config)
    if len(ranks) == 1:
        return config, first["module"]
    shards = [first["module"]] + [torch.load(p, map_location="cpu", weights_only=False)["module"] for _, p in ranks[1:]]
    tensor_parallel = first["ds_config"].get("tensor_parallel")
    if not tensor_parallel:
        raise DstrainError(f"{tag}: {len(ranks)} model-parallel shards but no tensor_parallel section in its ds_config")
    return config, consolidate_tensor_parallel(shards, tensor_parallel)
