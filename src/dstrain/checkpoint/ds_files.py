"""DeepSpeed's checkpoint files as dstrain reads them: their names, ``read_pt`` (dstrain.checkpoint.safe_load),
and the translation between a ZeRO-0 checkpoint and DeepSpeed's universal format, which DeepSpeed 0.19.8's converter
and loader do not cover (dstrain.checkpoint.reshard uses it to resume into or out of ZeRO-0)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dstrain.checkpoint import safe_load
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig

# DeepSpeed 0.19.8's file names inside a checkpoint tag, spelled here only.
ZERO12_MODEL_FILE = "mp_rank_00_model_states.pt"  # what a ZeRO-0/1/2 engine reads
ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # what a ZeRO-3 engine reads (rank 0's)
MODEL_FILES = "*model_states.pt"  # every model-state file, of any layout
OPTIM_FILES = "*_optim_states.pt"  # every rank's optimizer-state file
ZERO_MODEL_FILES = "zero_pp_rank_*_model_states.pt"  # ZeRO-3: one per data-parallel rank
ZERO_OPTIM_FILES = "zero_pp_rank_*_optim_states.pt"  # ZeRO-1/2/3 partitions
STAGE0_OPTIM_FILES = "zero_pp_rank_0_mp_rank_*_optim_states.pt"  # data-parallel rank 0's, one per model-parallel rank
PIPE_LAYER_FILES = "layer_*-model_states.pt"  # a pipeline engine's, one per layer
TP_RANK1_MODEL_FILE = "mp_rank_01_model_states.pt"  # present only when tensor-parallel ranks saved their shards
EXPERT_FILES = "layer_*_expert_*_mp_rank_*_model_states.pt"  # DeepSpeed MoE: one file per layer and expert
LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")
MP_RANK_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def optim_file_rank(path: Path) -> int:
    """The data-parallel rank of ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``."""
    return int(path.name.split("_")[3])


def check_groups(tag_dir: Path, saved: list[str], current: list[str]) -> None:
    """DeepSpeed's loaders zip the saved parameter groups with the current ones by position: a rank's groups must be
    the saved ones or their first few (a pipeline stage holds no group it has no parameter of), or state would land
    in the wrong group or be dropped silently."""
    if current != saved[: len(current)]:
        raise DstrainError(
            f"{tag_dir}: its optimizer's parameter groups are {saved}, this rank's are {current}, so DeepSpeed cannot "
            f"carry the optimizer state over; resume with the saved ds_config and rank count"
        )


def group_names(groups: list[dict]) -> list[str]:
    return [str(group.get("name", index)) for index, group in enumerate(groups)]


# --- ZeRO-0, which DeepSpeed's universal checkpoints do not cover -----------------------------------
# A ZeRO-0 checkpoint is the whole model plus torch's own optimizer state_dict, whose parameters are
# numbered in the order dstrain.model.gpt.param_groups hands them to the optimizer.


def _optimizer_order(model_config: GPTConfig, weight_decay: float) -> dict[str, list[str]]:
    """Each optimizer group's name -> its parameters' names, in the engine's order (built on the meta device)."""
    from dstrain.model.gpt import GPT, param_groups

    with torch.device("meta"):
        model = GPT(model_config)
    names = {id(p): n for n, p in model.named_parameters()}
    return {group["name"]: [names[id(p)] for p in group["params"]] for group in param_groups(model, weight_decay)}


def universal_from_zero0(tag_dir: Path, out: Path, model_config: GPTConfig, weight_decay: float) -> None:
    model_state = read_pt(tag_dir / ZERO12_MODEL_FILE)
    optimizer = model_state["optimizer"]
    order = _optimizer_order(model_config, weight_decay)
    for group, names in zip(optimizer["param_groups"], order.values()):
        for index, name in zip(group["params"], names):
            folder = out / "zero" / name
            folder.mkdir(parents=True)
            state = optimizer["state"][index]
            torch.save({"param": model_state["module"][name].float()}, folder / "fp32.pt")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.save({"param": state[key]}, folder / f"{key}.pt")
            torch.save(state["step"], folder / "step.pt")
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in optimizer["param_groups"]]
    torch.save(
        {
            "param_groups": groups,
            "ds_version": model_state["ds_version"],
            "clip_grad": model_state["ds_config"].get("gradient_clipping", 0.0),
        },
        out / "zero" / "optimizer_state.pt",
    )
    model_state.update(module=None, optimizer=None)
    torch.save(model_state, out / ZERO12_MODEL_FILE)


def zero0_from_universal(universal: Path, out: Path, model_config: GPTConfig, weight_decay: float) -> None:
    from dstrain.model.gpt import GPT

    model_state = read_pt(universal / ZERO12_MODEL_FILE)
    zero = universal / "zero"
    saved_groups = read_pt(zero / "optimizer_state.pt")["param_groups"]
    with torch.device("meta"):
        names = list(GPT(model_config).state_dict())  # tied weights appear under both names
    module = {name: read_pt(zero / name / "fp32.pt")["param"] for name in names if (zero / name).is_dir()}
    module["lm_head.weight"] = module.get("lm_head.weight", module["embed.tok.weight"])
    order = _optimizer_order(model_config, weight_decay)
    check_groups(universal.parent, group_names(saved_groups), list(order))
    state, groups, index = {}, [], 0
    for saved_group, names_of_group in zip(saved_groups, order.values()):
        groups.append({k: v for k, v in saved_group.items() if k != "params"} | {"params": []})
        for name in names_of_group:
            state[index] = {key: read_pt(zero / name / f"{key}.pt")["param"] for key in ("exp_avg", "exp_avg_sq")}
            state[index]["step"] = read_pt(zero / name / "step.pt")
            groups[-1]["params"].append(index)
            index += 1
    model_state.update(module=module, optimizer={"state": state, "param_groups": groups}, param_shapes=None)
    out.mkdir(parents=True)
    torch.save(model_state, out / ZERO12_MODEL_FILE)


def read_pt(path: Path):
    """Every read of a checkpoint file: dstrain.checkpoint.safe_load (torch.load with weights_only=True)."""
    return safe_load.load(path)
