"""Checks of the run folder and of ``init_from`` that need no process group, made before one starts.

Everything here only reads: a refused run leaves the user's files as they were.
"""

from __future__ import annotations

from pathlib import Path

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.run_dir import RunDir

# Besides RunDir.ALLOWED: the launch's own logs (a link to the Slurm job's log, compare's launcher.log).
LOG_SUFFIXES = (".log", ".out", ".err")


def check(recipe: Recipe, recipe_file: str, files: RunDir) -> None:
    check_run_dir_path(files)
    if recipe.init_from:
        check_init_from(recipe, recipe_file)


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
        return  # an earlier run's folder: run.check_run_dir compares the recipes
    try:
        names = [p.name for p in run_dir.iterdir()]
    except OSError:
        return  # unreadable: run.check_disk reports it
    foreign = sorted(
        n for n in names if n not in RunDir.ALLOWED and not n.startswith(".") and not n.endswith(LOG_SUFFIXES)
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DstrainError(f"run_dir {run_dir} holds files that no run wrote ({shown}); {fix}")


def check_init_from(recipe: Recipe, recipe_file: str) -> None:
    """init_from is a Hugging Face model folder (read from config.json only) or a dstrain run with an intact
    checkpoint, of the recipe's architecture."""
    from dstrain.model.hf import architecture_diff, config_from_hf

    assert recipe.init_from is not None
    try:
        if RunDir(Path(recipe.init_from)).recipe.is_file():  # a run: its newest intact checkpoint, its model
            from dstrain.checkpoint.consolidate import load_run

            config = load_run(recipe.init_from, None)[0].model
        else:
            config = config_from_hf(recipe.init_from)
    except DstrainError as e:
        raise DstrainError(f"{recipe_file}: init_from: {e}") from None
    differ = [f"model.{k}={ours!r} vs {theirs!r}" for k, ours, theirs in architecture_diff(recipe.model, config)]
    if differ:
        raise DstrainError(
            f"{recipe_file}: init_from {recipe.init_from} has another architecture ({'; '.join(differ)}); "
            f"set those model fields to the Hugging Face values"
        )
    check_data_tokenizer(recipe, recipe_file)


def check_data_tokenizer(recipe: Recipe, recipe_file: str) -> None:
    """Data for a published model is tokenised and framed with that model's tokenizer (when its folder has one)."""
    from dstrain.data.tokenizer import verify_tokenizer

    assert recipe.init_from is not None
    folder = Path(recipe.init_from)
    if RunDir(folder).recipe.is_file():
        folder = RunDir(folder).tokenizer  # a run's tokenizer, copied at its start
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return  # weights only: the data's own tokenizer stays the run's
    for source in recipe.data.sources:
        try:
            verify_tokenizer(source.path, folder, flag="init_from's tokenizer")
        except DstrainError as e:
            raise DstrainError(f"{recipe_file}: data.sources {source.path}: {e}") from None


def check_chat_sources(recipe: Recipe, manifests: list[dict], recipe_file: str) -> None:
    """An SFT recipe (data.sft) has a --chat source; a pretraining one none (it would learn every prompt token); a
    --chat source, packed whole, is read with document masking."""
    from dstrain.data.pairs import check_pair_sources

    check_pair_sources(recipe, manifests, f"{recipe_file}: ")
    chat = [s.path for s, m in zip(recipe.data.sources, manifests) if m.get("chat")]
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
