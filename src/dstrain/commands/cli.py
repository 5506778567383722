"""`dstrain <command>`: one sub-command per module, each owning its own flags.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> int``;
this file only dispatches, so a command's flags live next to its code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys

from dstrain.errors import DstrainError, OneLineArgumentParser

COMMANDS = {
    "prepare": ("dstrain.commands.prepare", "tokenize a Hugging Face dataset into packed shards"),
    "compare": (
        "dstrain.commands.compare",
        "run one recipe under several ds_configs and report speed, memory and loss",
    ),
    "estimate": ("dstrain.commands.estimate", "memory per device of a recipe under a ds_config, and whether it fits"),
    "plan": ("dstrain.commands.plan", "the fastest ds_config that fits a recipe on a cluster, predicted and written"),
    "export": ("dstrain.commands.export", "write a run's checkpoint as a Hugging Face model folder"),
    "eval": ("dstrain.commands.evaluate", "loss and perplexity of a run or Hugging Face model on a prepared split"),
    "generate": ("dstrain.commands.generate", "sample text from a run or Hugging Face model"),
    "doctor": (
        "dstrain.commands.doctor",
        "check that every strategy gives ZeRO-0's losses and gradient norms on this machine, and its kernels",
    ),
    "verify": ("dstrain.commands.verify", "check every checkpoint of a run against its recorded sizes and checksums"),
}


ACCELERATOR_NOTICE = "Setting accelerator to CPU"


@contextlib.contextmanager
def deepspeed_accelerator_notice_dropped():
    """DeepSpeed 0.19.x (accelerator/real_accelerator.py, get_accelerator) logs "Setting accelerator to CPU. If you
    have GPU or other accelerator, we were unable to detect it." as a WARNING, on stdout, the first time anything
    asks for the accelerator on a machine without one: the first line of `dstrain estimate`, `eval`, `generate` and
    `export`, and a line in eval's JSON output. The commands work on a CPU by design; the line is dropped while a
    command runs. Its logger ("DeepSpeed") exists before deepspeed is imported, and keeps the filter when DeepSpeed
    configures it. Training keeps the line in its rank logs (train/process/console.py)."""
    logger = logging.getLogger("DeepSpeed")
    logger.addFilter(_not_the_accelerator_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_accelerator_notice)


def _not_the_accelerator_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(ACCELERATOR_NOTICE)


def main(argv: list[str] | None = None) -> int:
    with deepspeed_accelerator_notice_dropped():
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
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
