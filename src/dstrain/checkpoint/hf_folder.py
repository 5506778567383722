"""A checkpoint tag as a Hugging Face transformers model folder: what `dstrain export` writes, and the trainer's
export of each published checkpoint (train.export_every). See dstrain.commands.export for what the folder holds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dstrain.config import Recipe
from dstrain.errors import DstrainError, warn


def write_hf_folder(recipe: Recipe, tag_dir: Path, tokenizer, out: Path, dtype: str, averaged: str | None = None):
    """The checkpoint ``tag_dir`` of a run of ``recipe`` into the new folder ``out``, written aside and renamed into
    place; (the transformers model, which weights it holds, the files carried from init_from). ``dtype``: "fp32" or
    "bf16"; ``averaged``: the weight average's kind ("" for the only one), None for the live weights."""
    import torch

    from dstrain.checkpoint.consolidate import consolidated_state_dict, weights_kind
    from dstrain.model.hf.convert import to_hf_model

    state, what = consolidated_state_dict(tag_dir, recipe.model), weights_kind(tag_dir)
    if averaged is not None:
        from dstrain.checkpoint.averaged import averaged_state_dict

        average, kind = averaged_state_dict(tag_dir, recipe.model, averaged or None)
        state.update(average)  # every parameter; buffers, if any, stay the live ones
        if recipe.model.tied:
            state["lm_head.weight"] = state["embed.tok.weight"]
        what = f"averaged ({kind})"
    if recipe.lora is not None:  # a full model of an adapter run: the adapters folded in (PEFT's merge_and_unload)
        from dstrain.adapters.lora import merged_state_dict

        state, what = merged_state_dict(state, recipe.model, recipe.lora), f"{what} (adapters merged)"
    model = to_hf_model(recipe.model, state, tokenizer)
    model.to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors
    tokenizer.save_pretrained(tmp)
    # An SFT run's tokenizer carries the chat template its data was rendered with: the published files would not.
    sft = recipe.data.sft
    carried = carry_published_files(recipe.init_from, tokenizer, tmp, not sft) if recipe.init_from is not None else []
    if sft:
        carried.append(f"the chat template's end of turn as eos_token_id {stop_at_end_of_turn(tmp, tokenizer)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # replaces an empty folder, never a full one
    return model, what, carried


# A published model's tokenizer and generation files, copied as they are: save_pretrained of a loaded tokenizer may
# rewrite them (added tokens, chat template, normalisation settings), which inference servers read.
PUBLISHED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def stop_at_end_of_turn(folder: Path, tokenizer) -> list[int]:
    """An exported chat model's generation_config.json stops at its template's end-of-turn token(s) and the EOS, so
    transformers' generate and inference servers end the assistant's turn where it was trained to; returns them."""
    from transformers import GenerationConfig

    from dstrain.data.chat import end_of_turn_ids

    path = folder / "generation_config.json"
    config = GenerationConfig.from_pretrained(folder) if path.is_file() else GenerationConfig()
    config.eos_token_id = end_of_turn_ids(tokenizer)
    config.save_pretrained(folder)
    return config.eos_token_id


def carry_published_files(init_from: str, tokenizer, out: Path, tokenizer_files: bool = True) -> list[str]:
    """Copies init_from's generation_config.json, and (``tokenizer_files``) its tokenizer files when the run's
    tokenizer has the same vocabulary (the data was prepared with it); returns the names copied from init_from."""
    source = Path(init_from)
    if not source.is_dir():
        return []
    copied = []
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
        copied.append("generation_config.json")
    if not tokenizer_files:
        return copied
    from dstrain.data.tokenizer import load_tokenizer

    try:
        published = load_tokenizer(str(source), flag="init_from's tokenizer")
    except DstrainError:
        return copied  # a model folder without a tokenizer: the run's stays
    if published.get_vocab() != tokenizer.get_vocab():
        warn(f"{source}: its tokenizer differs from the run's; the export holds the run's tokenizer")
        return copied
    for name in PUBLISHED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied
