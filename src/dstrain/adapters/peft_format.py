"""The adapter folder users load: PEFT's format (adapter_config.json, written by PEFT's own LoraConfig, and
adapter_model.safetensors with Hugging Face module names), written from a checkpoint by `dstrain export` and read back
by a recipe's lora.init_from.

    ours:  blocks.{i}.self_attn.lora.q_proj.lora_A.weight       (dstrain.adapters.lora)
    PEFT:  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight

The Hugging Face name of each target is the family's (dstrain.model.hf.families.block_names); a family that fuses
projections into one (Phi-3's qkv_proj) or the gpt2 flavour (GPT2's c_attn) has no per-projection name to adapt, and
is refused in one line. modules_to_save are PEFT's ``base_model.model.<hf name>.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstrain.adapters.config import LoraConfig, target_names
from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
SAVED_HF = {"embed.tok.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def expected_shapes(config: GPTConfig, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every adapter tensor of ``lora`` on ``config`` (and of its modules_to_save)."""
    from dstrain.adapters.config import layer_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    dims = layer_shapes(config)
    for i in range(config.n_layer):
        for target in target_names(lora, config):
            fan_in, fan_out = dims[target]
            key = f"blocks.{i}.{parent_of(target)}.lora.{target}"
            shapes[f"{key}.lora_A.weight"] = (lora.rank, fan_in)
            shapes[f"{key}.lora_B.weight"] = (fan_out, lora.rank)
    for name in lora.modules_to_save:
        shapes[{"embed_tokens": "embed.tok.weight", "lm_head": "lm_head.weight"}[name]] = (
            config.vocab_size,
            config.d_model,
        )
    return shapes


def parent_of(target: str) -> str:
    return "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def hf_names(config: GPTConfig, lora: LoraConfig) -> dict[str, str]:
    """Our adapter name -> PEFT's, for every tensor of expected_shapes."""
    from dstrain.model.hf import families

    if config.flavour != "llama" or families.FUSED.get(config.resolved_family):
        raise DstrainError(
            f"the {config.resolved_family} family fuses its projections in Hugging Face's form, which has no "
            f"per-projection name for a PEFT adapter; export the merged model with `dstrain export --merge`"
        )
    names = {}
    for i in range(config.n_layer):
        hf_of = dict(families.block_names(config, i))
        for target in target_names(lora, config):
            hf_weight = hf_of[f"{parent_of(target)}.{target}.weight"].removesuffix(".weight")
            for part in ("lora_A", "lora_B"):
                ours = f"blocks.{i}.{parent_of(target)}.lora.{target}.{part}.weight"
                names[ours] = f"{PEFT_PREFIX}model.layers.{i}.{hf_weight}.{part}.weight"
    for ours, hf in SAVED_HF.items():
        if ours in expected_shapes(config, lora):
            names[ours] = PEFT_PREFIX + hf
    return names


def reorder_rows(config: GPTConfig, name: str, tensor: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """Llama 4's q/k rows are reordered on import (dstrain.model.hf.convert): B's rows, which are q/k rows, too."""
    from dstrain.model.hf import families
    from dstrain.model.hf.convert import _interleaved_pairs

    rows_reordered = name.endswith(("q_proj.lora_B.weight", "k_proj.lora_B.weight"))
    if config.resolved_family in families.INTERLEAVED_ROPE and rows_reordered:
        return _interleaved_pairs(tensor, config.head_dim, back=to_hf)
    return tensor


def check_whole(state: dict[str, torch.Tensor], config: GPTConfig, lora: LoraConfig, where: str) -> None:
    """Every adapter tensor there, at its full size: a ZeRO-3 shard (torch.Size([0])) or a missing one is refused."""
    for name, shape in expected_shapes(config, lora).items():
        if name not in state:
            raise DstrainError(f"{where}: the adapter tensor {name} is missing; was the run trained with this lora:?")
        if tuple(state[name].shape) != shape:
            raise DstrainError(
                f"{where}: the adapter tensor {name} has shape {tuple(state[name].shape)}, the model's is {shape}; "
                f"it is not whole (a ZeRO-3 partition?) or from another model"
            )


def write_adapter_folder(recipe: Recipe, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> int:
    """The adapters in ``state`` (our names, fp32) as a PEFT folder ``out`` (new), written aside and renamed into
    place; the number of tensors written. Checks first that every tensor is whole."""
    import os
    import shutil

    import peft
    from safetensors.torch import save_file

    lora = recipe.lora
    assert lora is not None
    check_whole(state, recipe.model, lora, str(out))
    names = hf_names(recipe.model, lora)
    tensors = {
        hf: reorder_rows(recipe.model, ours, state[ours], to_hf=True).to(dtype).contiguous()
        for ours, hf in names.items()
    }
    hf_targets = sorted({hf.rsplit(".", 3)[-3] for hf in names.values() if ".lora_A." in hf})
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float scales alike
        lora_dropout=lora.dropout,
        target_modules=hf_targets,
        modules_to_save=[m for m in lora.modules_to_save] or None,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
        base_model_name_or_path=recipe.init_from,
    )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(str(tmp))
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # replaces an empty folder, never a full one
    return len(tensors)


def read_adapter_folder(folder: str | Path, recipe: Recipe, where: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder as our adapter state dict (fp32), checked against the recipe's lora: and model: its
    rank, alpha and targets must be the recipe's, and every tensor whole and of the model's shape."""
    from safetensors.torch import load_file

    lora = recipe.lora
    assert lora is not None
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise DstrainError(f"{where}: {folder} is not a PEFT adapter folder ({CONFIG_FILE} and {WEIGHTS_FILE})")
    saved = json.loads((folder / CONFIG_FILE).read_text())
    check_base(saved.get("base_model_name_or_path"), recipe, folder, where)
    names = hf_names(recipe.model, lora)
    wanted_targets = sorted({hf.rsplit(".", 3)[-3] for hf in names.values() if ".lora_A." in hf})
    theirs = saved.get("target_modules")
    theirs = sorted(theirs) if isinstance(theirs, list) else theirs
    for key, value, found in (("rank", lora.rank, saved.get("r")), ("alpha", lora.alpha, saved.get("lora_alpha"))):
        if found is None or float(found) != float(value):
            raise DstrainError(
                f"{where}: {folder} has {key} {found}, the recipe's lora.{key} is {value}; set it to {found}"
            )
    if theirs != wanted_targets or bool(saved.get("use_rslora")) != lora.use_rslora:
        raise DstrainError(
            f"{where}: {folder} adapts {theirs} (use_rslora {saved.get('use_rslora')}), the recipe's lora: "
            f"{wanted_targets} (use_rslora {lora.use_rslora}); set lora.target_modules and use_rslora to the folder's"
        )
    tensors = load_file(str(folder / WEIGHTS_FILE))  # safetensors: no code runs
    state = {}
    for ours, hf in names.items():
        if hf not in tensors:
            raise DstrainError(
                f"{where}: {folder} has no {hf}; its base is not the recipe's init_from ({recipe.init_from})"
            )
        state[ours] = reorder_rows(recipe.model, ours, tensors[hf].float(), to_hf=False)
    try:
        check_whole(state, recipe.model, lora, f"{where}: {folder}")
    except DstrainError as e:
        raise DstrainError(f"{e}; its base does not match the recipe's init_from ({recipe.init_from})") from None
    return state


def check_base(base: str | None, recipe: Recipe, folder: Path, where: str) -> None:
    """The folder's base_model_name_or_path names the recipe's init_from (by its last component: a Hub id and a
    local copy of it agree), where both are known."""
    if not base or not recipe.init_from:
        return
    if Path(base.rstrip("/")).name.lower() != Path(recipe.init_from.rstrip("/")).name.lower():
        raise DstrainError(
            f"{where}: {folder} was trained on {base}, the recipe's init_from is {recipe.init_from}; set init_from "
            f"to that base (or lora.init_from to an adapter of {recipe.init_from})"
        )


def load_adapter_into(model: torch.nn.Module, folder: str, recipe: Recipe, zero3: bool) -> None:
    """lora.init_from's adapters copied into the freshly injected ones (under ZeRO-3 gathered one at a time)."""
    state = read_adapter_folder(folder, recipe, "lora.init_from")
    from dstrain.adapters.lora import canonical_names

    params = dict(model.named_parameters())
    with torch.no_grad():
        for local, ours in canonical_names(model, recipe.model).items():
            if ours not in state:
                continue
            param = params[local]
            if not zero3:
                param.copy_(state[ours])
                continue
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    param.copy_(state[ours])
