"""The run folder of a launch: claimed by rank 0 (created, its disk checked, locked for the life of the run, a
previous run moved aside on a fresh start, the resolved inputs recorded) and summarised at the end."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import yaml

from dstrain.config import Recipe, recipe_paths, to_dict
from dstrain.errors import DstrainError, warn
from dstrain.run_dir import LAUNCH_KEY, LaunchRecord, RunDir, step_of
from dstrain.strategy.resolve import Strategy
from dstrain.train import plot


def launch_record(recipe: Recipe) -> LaunchRecord:
    """This launch's record (a tokenizer or init_from that names a Hub model has no path)."""
    cwd = Path.cwd()
    resolved = {key: (cwd / path).resolve() for key, path in recipe_paths(recipe).items()}
    return LaunchRecord(str(cwd), {key: str(path) for key, path in resolved.items() if path.exists()})


def lock_run_dir(run_dir: Path):
    """Held for the life of the run by global rank 0: a second run into the same folder is refused."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DstrainError(f"{run_dir} is in use by another run; wait for it or choose another run_dir") from None
    return handle


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
    from dstrain.model.counts import num_params

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
    # atomically: the other ranks' preflight may read it while rank 0 writes (seen in dstrain doctor under load:
    # an empty recipe.yaml read back as None); a dotfile, which check_run_dir ignores, until the rename
    written = files.recipe.with_name(f".{files.recipe.name}.partial")
    written.write_text(yaml.safe_dump({**to_dict(recipe), LAUNCH_KEY: asdict(launch_record(recipe))}, sort_keys=False))
    os.replace(written, files.recipe)
    if tag is None:
        from dstrain.data.tokenizer import copy_run_tokenizer

        copy_run_tokenizer(recipe.data, files.tokenizer)
    files.ds_config.write_text(json.dumps(strategy.resolved_ds_config, indent=2) + "\n")
    from dstrain.metrics import drop_records_after

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
