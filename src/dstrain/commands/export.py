"""`dstrain export` writes a run's checkpoint as a Hugging Face transformers model folder (a recipe's `init_from`
starts training from one: dstrain.train.engine.load_init_from).

    dstrain export runs/tiny --out hf/tiny                  # newest complete checkpoint
    dstrain export runs/tiny --tag global_step200 --out hf/tiny-200
    dstrain export runs/tiny --averaged --out hf/tiny-avg     # the weight average (recipe train.averaging)

The folder holds config.json, model.safetensors and the run's tokenizer (the run folder's own tokenizer/: nothing
outside the run folder is read). A run continued from a published model
(`init_from`) exports as that model's own class, with its generation_config.json and its tokenizer files as they
were (when the run's data was tokenised with the same vocabulary). The weights are the fp32 master
weights wherever the checkpoint holds them apart from the module's (bf16 runs: ZeRO's or BF16_Optimizer's
partitions), else the module's own (fp32 runs); `--dtype bf16` writes them rounded to bf16; llama-flavour models
become their family's class (LlamaForCausalLM, Qwen3ForCausalLM, ...), gpt2-flavour ones GPT2LMHeadModel
(dstrain.model.hf), so
`AutoModelForCausalLM.from_pretrained(folder)` computes what our GPT computed. An instruction-tuned run (data.sft)
keeps its own tokenizer, whose chat template rendered its data, and its generation_config.json stops at that
template's end of turn.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from dstrain.errors import DstrainError, warn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds recipe.yaml and checkpoints/)")
    parser.add_argument(
        "--tag", default=None, help="checkpoint tag, e.g. global_step200 (default: the newest complete)"
    )
    parser.add_argument("--out", required=True, help="new folder for the Hugging Face model (must not hold files)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="weights written: fp32 (the masters, default) or bf16 (half the size)",
    )
    parser.add_argument(
        "--averaged",
        nargs="?",
        const="",
        choices=("", "ema", "last_n"),
        default=None,
        help="write the checkpoint's weight average (train.averaging) instead of the live weights; name ema or last_n "
        "when the run keeps both",
    )


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DstrainError(f"--out {out} already exists and is not empty; choose a new folder")
    import torch

    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run, weights_kind
    from dstrain.data.tokenizer import load_run_tokenizer
    from dstrain.model.hf import to_hf_model

    recipe, tag_dir = load_run(args.run_dir, args.tag)
    tokenizer = load_run_tokenizer(args.run_dir)
    state, what = consolidated_state_dict(tag_dir, recipe.model), weights_kind(tag_dir)
    if args.averaged is not None:
        from dstrain.checkpoint.averaged import averaged_state_dict

        averaged, kind = averaged_state_dict(tag_dir, recipe.model, args.averaged or None)
        state.update(averaged)  # every parameter; buffers, if any, stay the live ones
        if recipe.model.tied:
            state["lm_head.weight"] = state["embed.tok.weight"]
        what = f"averaged ({kind})"
    model = to_hf_model(recipe.model, state, tokenizer)
    model.to(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors
    tokenizer.save_pretrained(tmp)
    # An SFT run's tokenizer carries the chat template its data was rendered with: the published files would not.
    sft = recipe.data.sft
    carried = carry_published_files(recipe.init_from, tokenizer, tmp, not sft) if recipe.init_from else []
    if sft:
        carried.append(f"the chat template's end of turn as eos_token_id {stop_at_end_of_turn(tmp, tokenizer)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # replaces an empty folder, never a full one
    print(
        f"{out}: {type(model).__name__} from {tag_dir} ({args.dtype} safetensors of the {what} "
        f"weights, tokenizer{''.join(f', {name}' for name in carried)})"
    )
    return 0


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
