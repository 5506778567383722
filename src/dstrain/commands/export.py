"""`dstrain export` writes a run's checkpoint as a Hugging Face transformers model folder (a recipe's `init_from`
starts training from one: dstrain.train.engine.load_init_from).

    dstrain export runs/tiny --out hf/tiny                  # newest complete checkpoint
    dstrain export runs/tiny --tag global_step200 --out hf/tiny-200

The folder holds config.json, model.safetensors and the run's tokenizer (the run folder's own tokenizer/: nothing
outside the run folder is read). The weights are the fp32 master
weights wherever the checkpoint holds them apart from the module's (bf16 runs: ZeRO's or BF16_Optimizer's
partitions), else the module's own (fp32 runs); `--dtype bf16` writes them rounded to bf16; llama-flavour models
become LlamaForCausalLM, gpt2-flavour ones GPT2LMHeadModel (dstrain.model.hf), so
`AutoModelForCausalLM.from_pretrained(folder)` computes what our GPT computed.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DstrainError(f"--out {out} already exists and is not empty; choose a new folder")
    import torch

    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run, weights_kind
    from dstrain.data.tokenizer import load_run_tokenizer
    from dstrain.model.hf import to_hf_model

    recipe, tag_dir = load_run(args.run_dir, args.tag)
    tokenizer = load_run_tokenizer(args.run_dir, recipe.data)
    model = to_hf_model(recipe.model, consolidated_state_dict(tag_dir, recipe.model), tokenizer)
    model.to(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # replaces an empty folder, never a full one
    print(
        f"{out}: {type(model).__name__} from {tag_dir} ({args.dtype} safetensors of the {weights_kind(tag_dir)} "
        f"weights, tokenizer)"
    )
    return 0
