"""A recipe file read into a typed ``Recipe``: the YAML, the command line's ``key=value`` overrides, the model fields
filled from ``init_from`` and from the prepared data, each field's type and range (dstrain.typed_yaml), then the checks
that span several fields (dstrain.recipe_checks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.recipe_checks import validate
from dstrain.run_dir import LAUNCH_KEY
from dstrain.typed_yaml import apply_override, parse, read_yaml_file


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply ``key=value`` overrides, and validate everything."""
    path = Path(path)
    try:
        raw = read_yaml_file(path, "pass a recipe YAML file, e.g. recipes/tiny.yaml")
    except FileNotFoundError:
        raise DstrainError(f"{path}: no such recipe file; see recipes/ for examples") from None
    except OSError as e:
        raise DstrainError(
            f"{path}: cannot read the recipe ({e.strerror}); pass a YAML file, e.g. recipes/tiny.yaml"
        ) from None
    if not isinstance(raw, dict):
        raise DstrainError(f"{path}: a recipe is a YAML mapping of sections (model, data, train, ...)")
    raw.pop(LAUNCH_KEY, None)  # what a run folder's recipe.yaml recorded of its launch: not a setting
    for item in overrides:
        apply_override(raw, item, path)
    refuse_moved_keys(raw, path)
    fill_model_from_init_from(raw, path)
    fill_model_defaults(raw, path)
    recipe = parse(Recipe, raw, path, "")
    validate(recipe, path)
    return recipe


def load_recipe_to_size(path: str | Path, overrides: Sequence[str], purpose: str) -> Recipe:
    """``load_recipe`` for what sizes a run without reading its data (dstrain estimate, plan): a refusal for want of
    the prepared data's manifest also names the override that does without it; ``purpose``: "estimate", "plan"."""
    try:
        return load_recipe(path, overrides)
    except DstrainError as e:
        hint = f"; to {purpose} without the data, pass model.vocab_size=<size>" if "manifest" in str(e) else ""
        raise DstrainError(f"{e}{hint}") from None


def refuse_moved_keys(raw: dict, path: Path) -> None:
    """model.activation_checkpointing, where nanoGPT-style recipes keep it, is a memory strategy: the ds_config's."""
    model = raw.get("model")
    if isinstance(model, dict) and "activation_checkpointing" in model:
        raise DstrainError(
            f"{path}: model.activation_checkpointing is a ds_config setting; remove it here and add "
            f'"activation_checkpointing": {{"partition_activations": false}} to your ds_config'
        )


def fill_model_from_init_from(raw: dict, path: Path) -> None:
    """With init_from, the model fields the recipe leaves out are the folder's (config.json only; no weights read).
    Training choices (doc_masking) stay the recipe's; the fields it gives are checked against the folder before any
    work (train/preflight.py), so a differing one is refused by name."""
    source, model = raw.get("init_from"), raw.get("model")
    if not isinstance(source, str) or not (model is None or isinstance(model, dict)):
        return  # no init_from, or parse() reports the malformed section
    from dstrain.run_dir import RunDir

    run = RunDir.find(source)
    if run:  # a dstrain run (an SFT after a continued run): the model its recipe resolved
        folder = dataclasses.asdict(load_recipe(run.recipe).model)
    elif model and not (Path(source) / "config.json").is_file():
        return  # written out (a shipped recipe on a machine without the weights): preflight checks the folder
    else:
        from dstrain.model.hf.convert import (
            architecture_from_hf,  # torch and transformers: only for a recipe with init_from
        )

        try:
            folder = dataclasses.asdict(architecture_from_hf(source))
        except DstrainError as e:
            raise DstrainError(f"{path}: init_from: {e}") from None
    del folder["doc_masking"]
    given = model or {}
    for key in ("moe", "rope_scaling"):  # one level deeper: moe.aux_loss_coef alone keeps the folder's experts
        if isinstance(given.get(key), dict) and isinstance(folder.get(key), dict):
            given[key] = {**folder[key], **given[key]}
    raw["model"] = {**folder, **given}


def fill_model_defaults(raw: dict, path: Path) -> None:
    """model.max_seq_len defaults to data.seq_len; model.vocab_size to the data's, padded to a multiple of 64;
    model.doc_masking to true under data.sft (a recipe that sets it false is refused by train/preflight.py)."""
    model, data = raw.get("model"), raw.get("data")
    if not isinstance(model, dict) or not isinstance(data, dict):
        return  # parse() reports the missing or malformed section
    model.setdefault("max_seq_len", data.get("seq_len"))
    if data.get("sft") is True:  # conversations are packed whole: read with document masking (preflight refuses false)
        model.setdefault("doc_masking", True)
    sources = data.get("sources")
    if model.get("vocab_size") is None and isinstance(sources, list) and sources:
        from dstrain.data.manifest import read_manifest

        if not isinstance(sources[0], dict) or not isinstance(sources[0].get("path"), str):
            return  # parse() reports the malformed source
        first = sources[0]["path"]
        vocab = read_manifest(first).vocab_size
        model["vocab_size"] = -(-vocab // 64) * 64
