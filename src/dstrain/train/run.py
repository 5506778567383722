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
import sys
from pathlib import Path

import yaml

from dstrain.config import Recipe, load_recipe, to_dict
from dstrain.errors import DstrainError
from dstrain.strategy import Strategy, load_ds_config, resolve

# Sections whose change makes a checkpoint meaningless for this run; the rest (length, cadence) may change.
IDENTITY_KEYS = ("model", "data", "seed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dstrain.train", description="Train a recipe under a ds_config.")
    parser.add_argument("--recipe", required=True, help="recipe YAML (the experiment)")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", required=True, help="ds_config JSON (the strategy)")
    parser.add_argument("--resume", default="auto", help="auto: newest complete checkpoint in run_dir; none: start fresh; or a tag")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.steps=100 optim.lr=1e-3")
    return parser.parse_args(argv)


def world_size_from_env() -> int:
    """Launchers export WORLD_SIZE (srun: SLURM_NTASKS); a plain `python -m dstrain.train` is a world of one."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def check_run_dir(recipe: Recipe, recipe_file: str, resume: str) -> None:
    """Refuse to mix a different experiment into an existing run directory."""
    saved = recipe.output_dir / "recipe.yaml"
    if resume == "none" or not saved.exists():
        return
    old = yaml.safe_load(saved.read_text())
    new = to_dict(recipe)
    changed = [k for k in IDENTITY_KEYS if old.get(k) != new.get(k)]
    if changed:
        raise DstrainError(
            f"{recipe.output_dir} holds a run of a different recipe ({', '.join(changed)} differ from {recipe_file}); "
            f"set run_dir=<new folder>, or --resume none to start over in it"
        )


def check_data(recipe: Recipe, recipe_file: str) -> str:
    """Every source prepared with one tokenizer that the model can embed; returns the data's fingerprint."""
    from dstrain.data.manifest import manifest_hash, read_manifest
    from dstrain.data.tokenizer import verify_tokenizer

    sources = recipe.data.sources
    manifests = [read_manifest(s.path) for s in sources]
    for source, manifest in zip(sources[1:], manifests[1:]):
        if manifest["tokenizer"]["hash"] != manifests[0]["tokenizer"]["hash"]:
            raise DstrainError(
                f"{recipe_file}: data.sources {source.path} and {sources[0].path} were prepared with different "
                f"tokenizers; prepare them with the same --tokenizer"
            )
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


def write_run_files(run_dir: Path, recipe: Recipe, strategy: Strategy) -> None:
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps(strategy.ds_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except DstrainError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dstrain: error: {e}", file=sys.stderr, flush=True)
        return 2


def train(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    strategy = resolve(recipe, args.recipe, load_ds_config(args.deepspeed_config), args.deepspeed_config, world_size_from_env())
    check_run_dir(recipe, args.recipe, args.resume)
    fingerprint = check_data(recipe, args.recipe)

    import torch

    from dstrain.data.dataset import build_dataset
    from dstrain.train import checkpoint, distributed
    from dstrain.train.engine import build_engine, build_model
    from dstrain.train.loop import Trainer

    distributed.init()
    rank = distributed.rank()
    run_dir = recipe.output_dir
    lock = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)
        write_run_files(run_dir, recipe, strategy)
    torch.distributed.barrier()

    sources = [(s.path, s.weight) for s in recipe.data.sources]
    d = recipe.data
    train_data = build_dataset(sources, "train", d.seq_len, recipe.seed, recipe.total_steps * recipe.train.global_batch, d.valid_fraction)
    valid_data = build_dataset(sources, "valid", d.seq_len, recipe.seed, None, d.valid_fraction)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    trainer = Trainer(recipe, strategy, engine, train_data, valid_data, run_dir, dp_rank=rank // strategy.tp_size,
                      data_fingerprint=fingerprint)
    tag = None
    if args.resume == "auto":
        tag = checkpoint.newest_complete(run_dir / "checkpoints")
    elif args.resume != "none":
        tag = args.resume
    if tag:
        trainer.resume(tag)
    result = trainer.fit(to_dict(recipe))
    if rank == 0:
        summary = {**result, "recipe": recipe.name, "strategy": strategy.name, "run_dir": str(run_dir)}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"{result['status']}: step {result['step']}; results in {run_dir}/ (metrics.jsonl, summary.json, checkpoints/)")
    torch.distributed.barrier()
    if lock:
        lock.close()
    return 0
