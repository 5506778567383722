"""`dstrain export` writes a run's checkpoint as a Hugging Face transformers model folder (a recipe's `init_from`
starts training from one: dstrain.train.engine.build.load_init_from).

    dstrain export runs/tiny --out hf/tiny                  # newest complete checkpoint
    dstrain export runs/tiny --tag global_step200 --out hf/tiny-200
    dstrain export runs/tiny --averaged --out hf/tiny-avg     # the weight average (recipe train.averaging)
    dstrain export runs/sft-lora --out hf/sft-lora-adapter   # a lora: run: its PEFT adapter folder
    dstrain export runs/sft-lora --merge --out hf/sft-lora    # ... or the whole model, the adapters merged in

A run with a recipe's lora: section exports its adapters as a PEFT folder (adapter_config.json and
adapter_model.safetensors with Hugging Face names, dstrain.adapters.peft_format), which
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)` loads on the run's init_from; --merge
writes the full model instead, each adapter folded into its weight from the consolidated checkpoint.

The folder holds config.json, model.safetensors and the run's tokenizer (the run folder's own tokenizer/: nothing
outside the run folder is read). A run continued from a published model
(`init_from`) exports as that model's own class, with its generation_config.json and its tokenizer files as they
were (when the run's data was tokenised with the same vocabulary). The weights are the fp32 master
weights wherever the checkpoint holds them apart from the module's (bf16 runs: ZeRO's or BF16_Optimizer's
partitions), else the module's own (fp32 runs); `--dtype bf16` writes them rounded to bf16; llama-flavour models
become their family's class (LlamaForCausalLM, Qwen3ForCausalLM, ...), gpt2-flavour ones GPT2LMHeadModel
(dstrain.model.hf.convert), so
`AutoModelForCausalLM.from_pretrained(folder)` computes what our GPT computed. An instruction-tuned run (data.sft)
keeps its own tokenizer, whose chat template rendered its data, and its generation_config.json stops at that
template's end of turn.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dstrain.errors import DstrainError


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
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a lora: run: the whole model with the adapters merged in, instead of the PEFT adapter folder",
    )


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DstrainError(f"--out {out} already exists and is not empty; choose a new folder")
    from dstrain.checkpoint.consolidate import load_run
    from dstrain.checkpoint.hf_folder import write_hf_folder
    from dstrain.data.tokenizer import load_run_tokenizer

    recipe, tag_dir = load_run(args.run_dir, args.tag)
    if args.merge and recipe.lora is None:
        raise DstrainError(f"--merge: {args.run_dir} has no lora: section (nothing to merge); leave out --merge")
    if recipe.lora is not None and not args.merge:
        return export_adapter(recipe, tag_dir, out, args)
    tokenizer = load_run_tokenizer(args.run_dir)
    model, what, carried = write_hf_folder(recipe, tag_dir, tokenizer, out, args.dtype, args.averaged)
    print(
        f"{out}: {type(model).__name__} from {tag_dir} ({args.dtype} safetensors of the {what} "
        f"weights, tokenizer{''.join(f', {name}' for name in carried)})"
    )
    return 0


def export_adapter(recipe, tag_dir: Path, out: Path, args: argparse.Namespace) -> int:
    """A lora: run's adapters as a PEFT folder, from the consolidated checkpoint (whole under every strategy)."""
    import torch

    from dstrain.adapters.peft_format import hf_names, write_adapter_folder
    from dstrain.checkpoint.consolidate import consolidated_state_dict

    if args.averaged is not None:
        raise DstrainError("--averaged: a lora: run's adapter export writes the live adapters; leave out --averaged")
    hf_names(recipe.model, recipe.lora)  # a family without a PEFT form is refused before the checkpoint is read
    state = consolidated_state_dict(tag_dir, recipe.model)
    count = write_adapter_folder(recipe, state, out, torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    print(f"{out}: PEFT adapter ({count} {args.dtype} tensors, rank {recipe.lora.rank}) from {tag_dir}")
    return 0
