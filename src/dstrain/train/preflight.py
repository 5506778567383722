"""Every check of a launch, made before the process group starts: the recipe, the ds_config, the monitors, the
prepared data, the run folder and the checkpoint to resume, and ``init_from``.

Everything here only reads: a refused run leaves the user's files as they were.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from dstrain.checkpoint.model_source import ModelSource, load_recipe_and_source
from dstrain.checkpoint.record import identity, identity_of_recipe_dict
from dstrain.config import Recipe, run_folder, to_dict
from dstrain.data.manifest import Manifest, read_manifest, same_tokenizer
from dstrain.errors import DstrainError, naming_files, quiet_warnings
from dstrain.monitors.settings import check_monitors
from dstrain.run_dir import RunDir
from dstrain.strategy.resolve import Strategy, load_ds_config, resolve
from dstrain.train.process.launcher_env import env_rank, env_world_size


@dataclass(frozen=True)
class CheckedInputs:
    recipe: Recipe
    strategy: Strategy
    files: RunDir  # the launch's run folder, the one RunDir of the launch
    manifests: list[Manifest]  # of data.sources, in order, each read once
    fingerprint: str  # the prepared data's
    tag: str | None  # the checkpoint to resume
    model_source: ModelSource | None  # init_from resolved once (a run, a Hugging Face folder), None without one


def checked_inputs(args: argparse.Namespace) -> CheckedInputs:
    """Every input checked, nothing written."""
    recipe, model_source = load_recipe_and_source(args.recipe, args.overrides)
    strategy = resolve(
        recipe, args.recipe, load_ds_config(args.deepspeed_config), args.deepspeed_config, env_world_size()
    )
    manifests = [read_manifest(data.path) for data in recipe.data.sources]  # once each, handed on
    files = RunDir(run_folder(recipe))
    check(recipe, args.recipe, files, manifests, model_source)
    with naming_files(ds_config=args.deepspeed_config):
        check_monitors(strategy.resolved_ds_config, files.root)
    fingerprint = fingerprint_of_checked_data(recipe, args.recipe, manifests)
    tag = resume_tag(files.checkpoints, args.resume)
    check_run_dir(recipe, args.recipe, files, tag, args.resume, fingerprint)
    if tag:
        from dstrain.checkpoint import nvme
        from dstrain.data.tokenizer import check_run_tokenizer
        from dstrain.train.features import averaging

        nvme.check_resume(files.checkpoints / tag, strategy)
        averaging.check_resume(files.checkpoints / tag, recipe.train.averaging, strategy)
        check_run_tokenizer(files.tokenizer, manifests[0], recipe.data.sources[0].path)
    from dstrain.tasks.loading import load_tasks

    with naming_files(tasks=args.recipe):
        load_tasks(recipe.train.tasks)  # every item readable; the tasks' component loads them again
    return CheckedInputs(recipe, strategy, files, manifests, fingerprint, tag, model_source)


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
        saved, new = (
            identity_of_recipe_dict(old, old["data"]["sources"]),
            identity(recipe, to_dict(recipe)["data"]["sources"]),
        )
    if (saved.adapters is None) != (new.adapters is None):
        trained, section = ("without", "sets a") if saved.adapters is None else ("with", "has no")
        raise DstrainError(
            f"{where} was trained {trained} LoRA adapters and {recipe_file} {section} lora: section; resume it as it "
            f"was trained, or set run_dir=<new folder> and init_from: {files.root} (adapters merged) to start from it"
        )
    changed = saved.differences(new)
    if changed:
        raise DstrainError(
            f"{where} holds a run of a different recipe ({', '.join(changed)} differ from {recipe_file}); "
            f"set run_dir=<new folder>, or --resume none to start over there (the previous run is moved aside)"
        )


def fingerprint_of_checked_data(recipe: Recipe, recipe_file: str, manifests: list[Manifest]) -> str:
    """Every source prepared with one tokenizer that the model can embed; returns the data's fingerprint."""
    from dstrain.data.manifest import check_shards
    from dstrain.data.tokenizer import verify_tokenizer

    sources = recipe.data.sources
    for source, manifest in zip(sources, manifests):
        check_shards(source.path, manifest)  # changed since it was prepared (between two launches, say)?
    for source, manifest in zip(sources[1:], manifests[1:]):
        fix = "prepare every source with the same --tokenizer"
        what = f"{recipe_file}: data.sources {source.path}"
        same_tokenizer(manifests[0], sources[0].path, manifest.tokenizer.hash, what, fix)
    check_chat_sources(recipe, manifests, recipe_file)
    if recipe.data.tokenizer is not None:
        verify_tokenizer(manifests[0], sources[0].path, recipe.data.tokenizer)
    vocab = manifests[0].vocab_size
    if recipe.model.vocab_size < vocab:
        raise DstrainError(
            f"{recipe_file}: model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's {vocab} "
            f"tokens of {sources[0].path}; raise model.vocab_size or remove it to use the data's"
        )
    identity = [(m.hash, s.weight) for m, s in zip(manifests, sources)]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


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


# Besides RunDir.ALLOWED: the launch's own logs (a link to the Slurm job's log, compare's launcher.log).
LOG_SUFFIXES = (".log", ".out", ".err")


def check(
    recipe: Recipe, recipe_file: str, files: RunDir, manifests: list[Manifest], source: ModelSource | None
) -> None:
    check_run_dir_path(files)
    if source is not None:
        check_init_from(recipe, recipe_file, manifests, source)


def check_run_dir_path(files: RunDir) -> None:
    """run_dir is a folder of its own: not a file, not under one, not prepared data, not someone's other files."""
    from dstrain.data.manifest import MANIFEST_NAME

    run_dir = files.root
    fix = "set run_dir=<a new or empty folder>"
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == run_dir else f"cannot be created: {parent} is a file"
            raise DstrainError(f"run_dir {run_dir} {what}; {fix}")
    if not run_dir.is_dir():
        return
    if (run_dir / MANIFEST_NAME).exists():
        raise DstrainError(
            f"run_dir {run_dir} is a folder prepared by dstrain prepare (it holds {MANIFEST_NAME}); {fix}"
        )
    if files.recipe.exists():
        return  # an earlier run's folder: check_run_dir compares the recipes
    try:
        names = [p.name for p in run_dir.iterdir()]
    except OSError:
        return  # unreadable: run_folder.check_disk reports it
    foreign = sorted(
        n for n in names if n not in RunDir.ALLOWED and not n.startswith(".") and not n.endswith(LOG_SUFFIXES)
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DstrainError(f"run_dir {run_dir} holds files that no run wrote ({shown}); {fix}")


def check_init_from(recipe: Recipe, recipe_file: str, manifests: list[Manifest], source: ModelSource) -> None:
    """init_from is a Hugging Face model folder (read from config.json only) or a dstrain run with an intact
    checkpoint, of the recipe's architecture."""
    from dstrain.model.hf.convert import architecture_diff

    try:
        config = source.checked_architecture()  # a run: its newest intact checkpoint's model
    except DstrainError as e:
        raise DstrainError(f"{recipe_file}: init_from: {e}") from None
    differ = [f"model.{k}={ours!r} vs {theirs!r}" for k, ours, theirs in architecture_diff(recipe.model, config)]
    if differ:
        raise DstrainError(
            f"{recipe_file}: init_from {recipe.init_from} has another architecture ({'; '.join(differ)}); "
            f"set those model fields to the Hugging Face values"
        )
    check_data_tokenizer(recipe, recipe_file, manifests, source)


def check_data_tokenizer(recipe: Recipe, recipe_file: str, manifests: list[Manifest], source: ModelSource) -> None:
    """Data for a published model is tokenised and framed with that model's tokenizer (when its folder has one)."""
    from dstrain.data.tokenizer import verify_tokenizer

    folder = source.tokenizer_folder  # a run's tokenizer, copied at its start
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return  # weights only: the data's own tokenizer stays the run's
    for data, manifest in zip(recipe.data.sources, manifests):
        try:
            verify_tokenizer(manifest, data.path, folder, flag="init_from's tokenizer")
        except DstrainError as e:
            raise DstrainError(f"{recipe_file}: data.sources {data.path}: {e}") from None


def check_chat_sources(recipe: Recipe, manifests: list[Manifest], recipe_file: str) -> None:
    """The recipe's objective trains on each source's kind of data (dstrain.objectives.registry); an SFT recipe
    (data.sft) has a --chat source; a pretraining one none (it would learn every prompt token); a --chat source,
    packed whole, is read with document masking."""
    from dstrain.objectives.registry import check_data

    check_data(recipe, manifests, recipe_file)  # the objective's own checks, and the kinds of data it trains on
    chat = [s.path for s, m in zip(recipe.data.sources, manifests) if m.chat is not None]
    if recipe.data.sft and not chat:
        raise DstrainError(
            f"{recipe_file}: data.sft is true but no data.sources folder was prepared with --chat (there is no loss "
            f"mask to learn the assistant's tokens by); prepare the conversations with `dstrain prepare --chat`"
        )
    if chat and not recipe.data.sft:
        raise DstrainError(
            f"{recipe_file}: data.sources {chat[0]} was prepared with --chat (conversations with a loss mask) but "
            f"data.sft is false; set data.sft: true, or prepare the text without --chat"
        )
    if chat and not recipe.model.doc_masking:
        raise DstrainError(
            f"{recipe_file}: model.doc_masking is false but data.sources {chat[0]} packs conversations whole (each "
            f"must attend only to itself, its positions restarting); remove model.doc_masking (true under data.sft)"
        )
