"""`dstrain generate`: text from a run's checkpoint or a Hugging Face model, through transformers' `generate`.

    dstrain generate runs/tiny --prompt "The os module" --max-new-tokens 40
    dstrain generate hf/tiny --prompt "def main():" --temperature 0     # greedy
    dstrain generate hf/sft-tiny --chat --system "Be brief." --prompt "What is json?"   # a chat model's reply

A run's checkpoint is converted in memory (dstrain.model.hf.convert.to_hf), exactly as `dstrain export` writes it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dstrain.errors import DstrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a run directory or a Hugging Face model folder")
    parser.add_argument("--prompt", help="text to continue; with --chat, the user's message")
    chat = parser.add_argument_group("chat models (docs/instruction-tuning.md)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="render --prompt (or --messages) with the tokenizer's chat template; stop at its end of turn; print the "
        "reply",
    )
    chat.add_argument("--system", default=None, help="--chat: a system message first")
    chat.add_argument(
        "--messages",
        metavar="FILE",
        default=None,
        help="--chat: a JSON list of {role, content} messages (a multi-turn conversation; --prompt, if given, is "
        "appended as the last user turn)",
    )
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
    messages = chat_messages(args) if args.chat else None
    if not args.chat and (args.system is not None or args.messages is not None):
        raise DstrainError("dstrain generate: --system and --messages render a conversation; add --chat")
    if messages is None and args.prompt is None:
        raise DstrainError("dstrain generate: --prompt TEXT is required (or --chat with --messages FILE)")
    reply = generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.tag, messages)
    print(reply, flush=True)
    return 0


def chat_messages(args: argparse.Namespace) -> list[dict]:
    """The conversation --chat renders: --system, the turns of --messages, --prompt as the last user turn."""
    from dstrain.data.chat import ExampleError, check_messages

    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    if args.messages is not None:
        try:
            messages += json.loads(Path(args.messages).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise DstrainError(f"--messages {args.messages}: not a readable JSON list of messages ({e})") from None
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
    try:
        return check_messages(messages, "the conversation (--system, --messages, --prompt)")
    except ExampleError as e:
        raise DstrainError(f"dstrain generate --chat: {e}; give a non-empty --prompt or fix --messages") from None


def generate(
    model_path: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    seed: int = 0,
    tag: str | None = None,
    messages: list[dict] | None = None,
) -> str:
    """The prompt followed by its continuation, decoded; with ``messages`` (a chat), the reply alone: the conversation
    rendered by the tokenizer's chat template, generation stopped at its end-of-turn token(s)."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.data.tokenizer import load_run_tokenizer, load_tokenizer
    from dstrain.model.hf.convert import to_hf_model

    if max_new_tokens <= 0 or temperature < 0:
        raise DstrainError("--max-new-tokens must be positive and --temperature zero or more")
    config, state, recipe = load_model_source(model_path, tag)
    if recipe is not None:
        tokenizer = load_run_tokenizer(model_path)
    else:
        tokenizer = load_tokenizer(str(model_path), flag="the model folder's tokenizer")
    model = to_hf_model(config, state, tokenizer)  # a HF folder goes through from_hf: its weights, verified
    stop = [tokenizer.eos_token_id]
    if messages is not None:
        ids, stop = _chat_prompt(tokenizer, messages)
    else:
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
            eos_token_id=stop,
            **sampling,
        )
    return tokenizer.decode(out[0, ids.shape[1] :] if messages is not None else out[0], skip_special_tokens=True)


def _chat_prompt(tokenizer, messages: list[dict]):
    """(the conversation's ids up to the assistant's turn, the ids that end that turn)."""
    from jinja2.exceptions import TemplateError

    from dstrain.data.chat import end_of_turn_ids

    if not getattr(tokenizer, "chat_template", None):
        raise DstrainError(
            "dstrain generate --chat: the model's tokenizer has no chat_template; tune it on data prepared with "
            "`dstrain prepare --chat` (which saves the template), or generate without --chat"
        )
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    except TemplateError as e:
        raise DstrainError(f"dstrain generate --chat: the chat template refuses the conversation: {e}") from None
    return ids["input_ids"], end_of_turn_ids(tokenizer)
