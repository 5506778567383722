"""One training run, from the command line to summary.json: the launch itself.

Everything that can be wrong with the inputs is checked before the process group starts (train/preflight.py), so a
bad recipe or ds_config fails in a second with one line, on every launcher; rank 0 then claims the run folder
(train/run_folder.py), and every rank builds the data, the model and the engine and trains.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import TYPE_CHECKING

from dstrain.checkpoint.record import identity
from dstrain.config import Recipe
from dstrain.errors import DISK_FULL_EXIT, DiskFull, DstrainError, OneLineArgumentParser
from dstrain.train.preflight import checked_inputs
from dstrain.train.process import console
from dstrain.train.process.launcher_env import env_rank
from dstrain.train.run_folder import claim_run_dir, write_summary

if TYPE_CHECKING:
    from dstrain.train.step.step_hooks import StepHooks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="dstrain.train", description="Train a recipe under a ds_config.")
    parser.add_argument("--recipe", required=True, help="recipe YAML (the experiment)")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", required=True, help="ds_config JSON (the strategy)")
    parser.add_argument(
        "--resume", default="auto", help="auto: newest complete checkpoint in run_dir; none: start fresh; or a tag"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"DeepSpeed's and other libraries' lines on the console too (or {console.VERBOSE_ENV}=1); "
        "they always go to run_dir/logs/rank<r>.log",
    )
    parser.add_argument(
        "--local_rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.steps=100 optim.lr=1e-3")
    return parser.parse_intermixed_args(argv)  # options may follow the overrides


def main(argv: list[str] | None = None, hooks: StepHooks | None = None) -> int:
    """``hooks``: a test's faults injected into the steps (dstrain.train.step.step_hooks.StepHooks)."""
    console.start(console.verbose_requested(sys.argv[1:] if argv is None else argv))
    rank = env_rank()
    error = None
    try:
        return train(parse_args(argv), hooks)
    except DiskFull as e:  # every rank raises it together (checkpoint.store.agree_written); one line, no requeue
        if rank == 0:
            print(f"dstrain: error: {e}", file=sys.stderr, flush=True)
        return DISK_FULL_EXIT
    except DstrainError as e:
        if rank == 0:
            print(f"dstrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        # Name the rank: in a 64-rank job the first failure is the one worth reading.
        print(
            f"dstrain: rank {rank} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
            flush=True,
        )
        error = traceback.format_exc()
        raise
    finally:
        console.end(error)


def training_data(recipe: Recipe):
    """(train set, valid sets) of the recipe's data, its stages and repetition caps. Index arrays are built under a
    file lock by whichever rank comes first; broken shards fail here."""
    from dstrain.data.dataset import build_dataset, build_valid_sets

    d, gb = recipe.data, recipe.train.global_batch
    sources = [(s.path, s.weight) for s in d.sources]
    stages = [(first * gb, weights) for first, weights in recipe.stage_starts()[1:]]
    max_epochs = [s.max_epochs for s in d.sources]
    train_data = build_dataset(
        sources,
        "train",
        d.seq_len,
        recipe.seed,
        recipe.total_steps * gb,
        d.valid_fraction,
        None,
        stages,
        max_epochs,
        d.overlong,
    )
    return train_data, build_valid_sets(sources, d.seq_len, recipe.seed, d.valid_fraction, overlong=d.overlong)


def train(args: argparse.Namespace, hooks: StepHooks | None = None) -> int:
    inputs = checked_inputs(args)
    recipe, strategy, files, tag = inputs.recipe, inputs.strategy, inputs.files, inputs.tag
    import torch

    from dstrain.train.engine.build import build_engine, build_model, load_init_from
    from dstrain.train.loop import Trainer
    from dstrain.train.process import distributed

    train_data, valid_sets = training_data(recipe)

    from deepspeed.accelerator import get_accelerator

    from dstrain.train.features.watchdog import enable_flight_recorder

    if recipe.train.watchdog.enabled:
        enable_flight_recorder(files, get_accelerator().communication_backend_name())
    distributed.init()
    rank = distributed.rank()
    lock = distributed.on_rank0(lambda: claim_run_dir(files, recipe, strategy, tag), f"use {files.root}")
    console.open_log(files, rank)

    if tag:  # saved under another world size or ZeRO stage? rank 0 converts it, the others wait
        from dstrain.checkpoint import reshard

        reshard.prepare_resume(
            files.checkpoints, tag, strategy, recipe.model, recipe.optim.weight_decay, on_rank0=distributed.on_rank0
        )
    model = build_model(recipe, strategy)
    if inputs.model_source is not None and not tag:  # continued pretraining starts from init_from's weights, once
        ep_rank = strategy.ep_rank(torch.distributed.get_rank())
        zero3 = strategy.zero_stage == 3
        load_init_from(model, recipe, args.recipe, inputs.model_source, zero3, strategy.ep_size, ep_rank)
    engine = build_engine(recipe, strategy, model)
    fingerprint, run_identity = inputs.fingerprint, identity(recipe, inputs.fingerprint)
    trainer = Trainer(
        recipe, strategy, engine, train_data, valid_sets, files, fingerprint, run_identity, hooks, inputs.model_source
    )
    if tag:
        trainer.resume(tag)
    try:
        result = trainer.fit()
    except DstrainError as e:  # DiskFull too: the dashboards say why the run stopped
        trainer.log.stopped(trainer.progress.step, e, DISK_FULL_EXIT if isinstance(e, DiskFull) else 2)
        raise
    if rank == 0:
        write_summary(files, result, recipe, strategy)
    torch.distributed.barrier()
    if lock:
        lock.close()
    return 0
