"""`dstrain prepare`: tokenize a Hugging Face dataset into packed shards (dstrain.data.prepare does the work)."""

from __future__ import annotations

import argparse
import time
from dataclasses import fields

from dstrain.data.prepare import DEFAULT_SHARD_TOKENS, PrepareOptions, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("source")
    source.add_argument(
        "--dataset",
        required=True,
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
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="Hugging Face fast tokenizer (name or folder)")
    tok.add_argument(
        "--train-tokenizer",
        metavar="VOCAB_SIZE",
        type=int,
        help="train a byte-level BPE of this vocabulary size on the data",
    )
    parser.add_argument("--out", required=True, help="output folder (shards, tokenizer/, manifest.json)")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"at most this many tokens per shard (default: {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    options = {f.name: getattr(args, f.name) for f in fields(PrepareOptions) if f.name != "progress"}
    manifest = run(PrepareOptions(**options, progress=not args.no_progress))
    seconds = time.perf_counter() - start
    print(
        f"{args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"in {len(manifest['shards'])} shard(s), {manifest['dtype']}, vocab {manifest['vocab_size']:,} "
        f"({seconds:.1f} s)"
    )
    return 0
