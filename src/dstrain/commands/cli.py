"""`dstrain <command>`: one sub-command per module, each owning its own flags.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> int``;
this file only dispatches, so a command's flags live next to its code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dstrain.errors import DstrainError, OneLineArgumentParser

COMMANDS = {
    "prepare": ("dstrain.commands.prepare", "tokenize a Hugging Face dataset into packed shards"),
    "compare": (
        "dstrain.commands.compare",
        "run one recipe under several ds_configs and report speed, memory and loss",
    ),
    "estimate": ("dstrain.commands.estimate", "memory per device of a recipe under a ds_config, and whether it fits"),
    "export": ("dstrain.commands.export", "write a run's checkpoint as a Hugging Face model folder"),
    "eval": ("dstrain.commands.evaluate", "loss and perplexity of a run or Hugging Face model on a prepared split"),
    "generate": ("dstrain.commands.generate", "sample text from a run or Hugging Face model"),
    "verify": ("dstrain.commands.verify", "check every checkpoint of a run against its recorded sizes and checksums"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineArgumentParser(prog="dstrain", description="DeepSpeed training recipes for GPT-style models")
    # The deepspeed launcher passes --local_rank before the command (`deepspeed --module dstrain eval ...`).
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(module=module)
        if name == chosen:  # only the named command's module is imported: `dstrain --help` loads no torch
            importlib.import_module(module).add_arguments(command)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args.module).main(args) or 0
    except DstrainError as e:
        print(f"dstrain: error: {e}", file=sys.stderr)
        return 2
