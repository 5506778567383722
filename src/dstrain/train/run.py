"""One training run, from the command line to summary.json.

Everything that can be wrong with the inputs is checked before the process group
starts, so a bad recipe or ds_config fails in a second with one line, on every launcher.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dstrain.checkpoint.record import Identity
from dstrain.config import Recipe, load_recipe, to_dict
from dstrain.errors import DISK_FULL_EXIT, DiskFull, DstrainError, OneLineArgumentParser, quiet_warnings, warn
from dstrain.monitors.settings import check_monitors
from dstrain.run_dir import LAUNCH_KEY, LaunchRecord, RunDir, step_of
from dstrain.strategy.resolve import Strategy, load_ds_config, resolve
from dstrain.train import console, plot, preflight
from dstrain.train.launcher_env import env_rank, env_world_size

if TYPE_CHECKING:
    from dstrain.train.steps import StepHooks


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


def identity(recipe: Recipe, data: str | list) -> Identity:
    """What a checkpoint records of its experiment (in dstrain_checkpoint.json), for check_run_dir to compare: the
    model, what it reads (``data``: the data's fingerprint), the seed, and which optimizer's state it holds. The rest
    of the recipe (the optimizer's hyper-parameters, schedule, length, cadence) may change on resume, and the current
    recipe's values apply."""
    return _identity(to_dict(recipe), data)


def _identity(recipe: dict, data: str | list) -> Identity:
    return Identity(
        model=recipe["model"],
        seq_len=recipe["data"]["seq_len"],
        valid_fraction=recipe["data"]["valid_fraction"],
        data=data,
        seed=recipe["seed"],
        optimizer=recipe["optim"]["kind"],
    )


def check_run_dir(
    recipe: Recipe, recipe_file: str, files: RunDir, tag: str | None, resume: str, data_fingerprint: str
) -> None:
    """Refuse to continue a checkpoint of another experiment: its own record, not run_dir's recipe.yaml, says
    what it is. Without a checkpoint that records it (none yet, or one saved with identity=None), run_dir's
    recipe.yaml does, unless --resume none starts over (and moves that run aside)."""
    from dstrain.checkpoint import store

    where = files.checkpoints / tag if tag else files.recipe
    record = store.read_record(where) if tag else None
    saved = record.identity if record else None
    new = identity(recipe, data_fingerprint)
    if saved is None:
        if resume == "none" or not files.recipe.exists():
            return
        where = files.recipe
        old = yaml.safe_load(where.read_text())
        saved, new = _identity(old, old["data"]["sources"]), identity(recipe, to_dict(recipe)["data"]["sources"])
    changed = saved.differences(new)
    if changed:
        raise DstrainError(
            f"{where} holds a run of a different recipe ({', '.join(changed)} differ from {recipe_file}); "
            f"set run_dir=<new folder>, or --resume none to start over there (the previous run is moved aside)"
        )


def fingerprint_of_checked_data(recipe: Recipe, recipe_file: str) -> str:
    """Every source prepared with one tokenizer that the model can embed; returns the data's fingerprint."""
    from dstrain.data.manifest import check_shards, manifest_hash, read_manifest
    from dstrain.data.tokenizer import check_same_tokenizer, verify_tokenizer

    sources = recipe.data.sources
    manifests = [read_manifest(s.path) for s in sources]
    for source, manifest in zip(sources, manifests):
        check_shards(source.path, manifest)  # changed since it was prepared (between two launches, say)?
    check_same_tokenizer(
        sources[0].path,
        [s.path for s in sources[1:]],
        "prepare every source with the same --tokenizer",
        where=f"{recipe_file}: data.sources ",
    )
    preflight.check_chat_sources(recipe, manifests, recipe_file)
    if recipe.data.tokenizer:
        verify_tokenizer(sources[0].path, recipe.data.tokenizer)
    vocab = manifests[0]["vocab_size"]
    if recipe.model.vocab_size < vocab:
        raise DstrainError(
            f"{recipe_file}: model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's {vocab} "
            f"tokens of {sources[0].path}; raise model.vocab_size or remove it to use the data's"
        )
    identity = [(manifest_hash(m), s.weight) for m, s in zip(manifests, sources)]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


def lock_run_dir(run_dir: Path):
    """Held for the life of the run by global rank 0: a second run into the same folder is refused."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DstrainError(f"{run_dir} is in use by another run; wait for it or choose another run_dir") from None
    return handle


def resume_tag(checkpoint_dir: Path, resume: str) -> str | None:
    from dstrain.checkpoint import store

    if resume == "none":
        return None
    with quiet_warnings(env_rank() != 0):  # a damaged tag is reported once, by rank 0
        tag = store.newest_complete(checkpoint_dir) if resume == "auto" else resume
    if resume != "auto" and (problem := store.damage(checkpoint_dir / resume)):
        raise DstrainError(f"--resume {resume}: {problem}; use --resume auto (the newest intact checkpoint)")
    if tag:
        store.check_loadable(checkpoint_dir / tag)
    return tag


def move_previous_run(files: RunDir) -> Path | None:
    """A fresh start in a run_dir that holds a run: move that run's files into previous/<UTC time>/, delete nothing."""
    import datetime

    leftovers = files.written()
    if not leftovers:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = files.previous / stamp
    suffix = 1
    while dest.exists():
        dest, suffix = files.previous / f"{stamp}-{suffix}", suffix + 1
    dest.mkdir(parents=True)
    for path in leftovers:
        os.replace(path, dest / path.name)
    print(f"{files.root} held a previous run; moved it to {dest}/ (nothing deleted)", flush=True)
    return dest


def check_disk(run_dir: Path, recipe: Recipe) -> None:
    """Fail now, not at the first checkpoint hours from now, if run_dir cannot hold one."""
    from dstrain.model.config import num_params

    try:
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise DstrainError(
            f"run_dir {run_dir} is not writable ({e.strerror}); set run_dir=<a writable folder>"
        ) from None
    # fp32 master weights + two Adam moments + the model's own copy: at most 16 bytes per parameter.
    checkpoint_bytes = 16 * num_params(recipe.model)
    free = shutil.disk_usage(run_dir).free
    if free < checkpoint_bytes:
        raise DstrainError(
            f"run_dir {run_dir} has {free / 2**30:.1f} GiB free, "
            f"one checkpoint needs ~{checkpoint_bytes / 2**30:.1f} GiB; "
            f"free space or set run_dir=<a larger filesystem>"
        )
    if free < (recipe.train.keep_last + 1) * checkpoint_bytes:
        warn(f"run_dir {run_dir}: {free / 2**30:.1f} GiB free holds fewer than train.keep_last+1 checkpoints")


def claim_run_dir(files: RunDir, recipe: Recipe, strategy: Strategy, tag: str | None):
    """Rank 0: lock the run directory, check its disk, move a previous run aside when starting fresh, record the
    resolved inputs, and drop the metrics a resumed run is about to log again (those after its checkpoint)."""
    run_dir = files.root
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DstrainError(
            f"run_dir {run_dir} cannot be created ({e.strerror}); set run_dir=<a writable folder>"
        ) from None
    check_disk(run_dir, recipe)
    lock = lock_run_dir(run_dir)
    if tag is None:
        move_previous_run(files)
    files.recipe.write_text(
        yaml.safe_dump({**to_dict(recipe), LAUNCH_KEY: asdict(LaunchRecord.of(recipe))}, sort_keys=False)
    )
    if tag is None:
        from dstrain.data.tokenizer import copy_run_tokenizer

        copy_run_tokenizer(recipe.data, files.tokenizer)
    files.ds_config.write_text(json.dumps(strategy.ds_config, indent=2) + "\n")
    from dstrain.metrics_records import drop_records_after

    drop_records_after(files.metrics, step_of(tag) if tag else 0)
    return lock


def write_summary(files: RunDir, result: dict, recipe: Recipe, strategy: Strategy) -> None:
    """Rank 0, at the end of a finished or interrupted run: summary.json, loss.png, and where they are."""
    summary = {**result, "recipe": recipe.name, "strategy": strategy.name, "run_dir": str(files.root)}
    files.summary.write_text(json.dumps(summary, indent=2) + "\n")
    status, step = result["status"], result["step"]
    picture = plot.try_plot_run(files, f"{recipe.name} under {strategy.name}: {status} at step {step}")
    print(f"{status}: step {step}; results in {files.root}/ (metrics.jsonl, summary.json, checkpoints/, logs/)")
    if picture:
        print(f"loss curve: {picture}", flush=True)


def main(argv: list[str] | None = None, hooks: StepHooks | None = None) -> int:
    """``hooks``: a test's faults injected into the steps (dstrain.train.steps.StepHooks)."""
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


@dataclass(frozen=True)
class CheckedInputs:
    recipe: Recipe
    strategy: Strategy
    files: RunDir  # the launch's run folder, the one RunDir of the launch
    fingerprint: str  # the prepared data's
    tag: str | None  # the checkpoint to resume
    task_items: list  # the train.tasks' items (dstrain.tasks.loading.load_tasks)


def checked_inputs(args: argparse.Namespace) -> CheckedInputs:
    """Every input checked, nothing written."""
    recipe = load_recipe(args.recipe, args.overrides)
    strategy = resolve(
        recipe, args.recipe, load_ds_config(args.deepspeed_config), args.deepspeed_config, env_world_size()
    )
    files = RunDir.of(recipe)
    preflight.check(recipe, args.recipe, files)
    check_monitors(strategy.ds_config, args.deepspeed_config, files.root)
    fingerprint = fingerprint_of_checked_data(recipe, args.recipe)
    tag = resume_tag(files.checkpoints, args.resume)
    check_run_dir(recipe, args.recipe, files, tag, args.resume, fingerprint)
    if tag:
        from dstrain.checkpoint import nvme
        from dstrain.data.tokenizer import check_run_tokenizer
        from dstrain.train import averaging

        nvme.check_resume(files.checkpoints / tag, strategy)
        averaging.check_resume(files.checkpoints / tag, recipe.train.averaging, strategy)
        check_run_tokenizer(files.tokenizer, recipe.data.sources[0].path)
    from dstrain.tasks.loading import load_tasks

    return CheckedInputs(recipe, strategy, files, fingerprint, tag, load_tasks(recipe.train.tasks, args.recipe))


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


def task_requests(recipe: Recipe, task_items) -> list:
    """The train.tasks' items as scoring requests, in the data's own tokenizer."""
    if not task_items:
        return []
    from dstrain.data.tokenizer import load_tokenizer, run_tokenizer_dir
    from dstrain.tasks import scoring

    tokenizer = load_tokenizer(str(run_tokenizer_dir(recipe.data)), flag="data.tokenizer")
    return scoring.prepare(task_items, tokenizer, recipe.model.max_seq_len)


def train(args: argparse.Namespace, hooks: StepHooks | None = None) -> int:
    inputs = checked_inputs(args)
    recipe, strategy, files, tag = inputs.recipe, inputs.strategy, inputs.files, inputs.tag
    import torch

    from dstrain.train import distributed
    from dstrain.train.engine import build_engine, build_model, load_init_from
    from dstrain.train.loop import Trainer

    tasks = task_requests(recipe, inputs.task_items)
    train_data, valid_sets = training_data(recipe)

    from deepspeed.accelerator import get_accelerator

    from dstrain.train.watchdog import enable_flight_recorder

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
    if recipe.init_from and not tag:  # continued pretraining starts from a Hugging Face model, once
        ep_rank = strategy.ep_rank(torch.distributed.get_rank())
        load_init_from(model, recipe, args.recipe, strategy.zero_stage == 3, strategy.ep_size, ep_rank)
    engine = build_engine(recipe, strategy, model)
    fingerprint, run_identity = inputs.fingerprint, identity(recipe, inputs.fingerprint)
    trainer = Trainer(recipe, strategy, engine, train_data, valid_sets, files, fingerprint, run_identity, tasks, hooks)
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
