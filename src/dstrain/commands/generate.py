"""`dstrain generate`: text from a run's checkpoint or a Hugging Face model, through transformers' `generate`.

    dstrain generate runs/tiny --prompt "The os module" --max-new-tokens 40
    dstrain generate hf/tiny --prompt "def main():" --temperature 0     # greedy

A run's checkpoint is converted in memory (dstrain.model.hf.to_hf), exactly as `dstrain export` writes it.
"""

from __future__ import annotations

import argparse

import torch

from dstrain.errors import DstrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a run directory or a Hugging Face model folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: 64")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sample from the whole distribution at this temperature; 0 = greedy (default: 0.8)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--tag", help="checkpoint tag of a run (default: the newest complete)")


def main(args: argparse.Namespace) -> int:
    print(generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.tag), flush=True)
    return 0


def generate(
    model_path: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    seed: int = 0,
    tag: str | None = None,
) -> str:
    """The prompt followed by its continuation, decoded."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.data.tokenizer import load_run_tokenizer, load_tokenizer
    from dstrain.model.hf import to_hf_model

    if max_new_tokens <= 0 or temperature < 0:
        raise DstrainError("--max-new-tokens must be positive and --temperature zero or more")
    config, state, recipe = load_model_source(model_path, tag)
    if recipe is not None:
        tokenizer = load_run_tokenizer(model_path)
    else:
        tokenizer = load_tokenizer(str(model_path), flag="the model folder's tokenizer")
    model = to_hf_model(config, state, tokenizer)  # a HF folder goes through from_hf: its weights, verified
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise DstrainError("--prompt is empty; give some text to continue")
    if config.position_limit and ids.shape[1] + max_new_tokens > config.position_limit:
        raise DstrainError(
            f"--prompt ({ids.shape[1]} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
            f"{config.position_limit} positions; shorten them"
        )
    torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)
