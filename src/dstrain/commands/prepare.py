"""`dstrain prepare`: tokenize a Hugging Face dataset into packed shards (dstrain.data.prepare does the work)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

from dstrain.data.manifest import MANIFEST_NAME
from dstrain.data.prepare import DEFAULT_SHARD_TOKENS, PrepareOptions, run
from dstrain.data.prepare_parts import merge
from dstrain.errors import DstrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("source")
    source.add_argument(
        "--dataset",
        help="Hub id, save_to_disk folder, data folder, or json/jsonl(.gz)/parquet/csv/txt file(s) or glob",
    )
    source.add_argument("--dataset-config", default=None, help="dataset configuration name")
    source.add_argument("--split", default="train", help="split to tokenize (default: train)")
    source.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    source.add_argument(
        "--streaming",
        action="store_true",
        help="stream the dataset instead of downloading/converting it first (corpora larger than disk)",
    )
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="Hugging Face fast tokenizer (name or folder)")
    tok.add_argument(
        "--train-tokenizer",
        metavar="VOCAB_SIZE",
        type=int,
        help="train a byte-level BPE of this vocabulary size on the data",
    )
    chat = parser.add_argument_group("instruction tuning (docs/instruction-tuning.md)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="conversations ('messages', 'prompt'/'completion', or TRL's preference pairs 'chosen'/'rejected' with an "
        "optional 'prompt') rendered by the tokenizer's chat template, "
        "with a loss mask on the assistant's tokens",
    )
    chat.add_argument(
        "--chat-template", metavar="FILE", default=None, help="--chat: a Jinja template file to use instead"
    )
    parser.add_argument("--out", help="output folder (shards, tokenizer/, manifest.json)")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"at most this many tokens per shard (default: {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    tasks = parser.add_argument_group("across nodes (docs/data.md)")
    tasks.add_argument(
        "--num-tasks",
        type=int,
        default=None,
        help="prepare as one of N tasks, each a 1/N part under OUT/tasks/ (default: SLURM_ARRAY_TASK_COUNT)",
    )
    tasks.add_argument(
        "--task-index", type=int, default=None, help="this task's index in [0, N) (default: SLURM_ARRAY_TASK_ID)"
    )
    tasks.add_argument(
        "--merge",
        metavar="OUT",
        default=None,
        help="write OUT/manifest.json over every finished task's shards (the last task to finish does it too)",
    )


def _merge(args: argparse.Namespace) -> int:
    given = [flag for flag, value in (("--dataset", args.dataset), ("--out", args.out)) if value is not None]
    if given:
        raise DstrainError(f"dstrain prepare --merge OUT takes only the output folder; drop {' and '.join(given)}")
    manifest = merge(args.merge)
    print(
        f"{args.merge}: merged {len(manifest['shards'])} shard(s), {manifest['documents']:,} documents, "
        f"{manifest['tokens']:,} tokens"
    )
    return 0


def main(args: argparse.Namespace) -> int:
    if args.merge is not None:
        return _merge(args)
    missing = [flag for flag, value in (("--dataset", args.dataset), ("--out", args.out)) if value is None]
    if missing:
        raise DstrainError(f"dstrain prepare: {' and '.join(missing)} required (or --merge OUT alone)")
    start = time.perf_counter()
    options = {f.name: getattr(args, f.name) for f in fields(PrepareOptions) if f.name != "progress"}
    manifest = run(PrepareOptions(**options, progress=not args.no_progress))
    seconds = time.perf_counter() - start
    task = manifest.get("task")
    where = f"{args.out} (task {task['index']} of {task['count']})" if task else args.out
    print(
        f"{where}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"in {len(manifest['shards'])} shard(s), {manifest['dtype']}, vocab {manifest['vocab_size']:,} "
        f"({seconds:.1f} s)"
    )
    if manifest.get("chat"):
        print(_chat_summary(manifest["chat"], manifest["tokens"]))
    if manifest.get("pairs"):
        pairs = manifest["pairs"]
        longer = ", ".join(f"{n} > {length} + 1" for length, n in pairs["longer_than"].items() if n) or "none"
        print(
            f"preference pairs: {pairs['pairs']:,} (chosen and rejected neighbouring documents); longest pair "
            f"{pairs['longest']:,} tokens; pairs longer than a seq_len + 1: {longer}"
        )
    if task and (merged := Path(args.out) / MANIFEST_NAME).is_file():
        total = json.loads(merged.read_text(encoding="utf-8"))
        print(f"{args.out}: every task done, merged: {total['documents']:,} documents, {total['tokens']:,} tokens")
    return 0


def _chat_summary(chat: dict, tokens: int) -> str:
    longer = ", ".join(f"{n} > {length}" for length, n in chat["longer_than"].items() if n) or "none"
    return (
        f"chat ({chat['format']}, mask from {chat['mask_from']}): {chat['learned_tokens']:,} learned tokens "
        f"({chat['learned_tokens'] / max(tokens, 1):.0%}); longest example {chat['longest']:,} tokens; examples longer "
        f"than a seq_len (data.overlong truncates or drops them): {longer}"
    )
