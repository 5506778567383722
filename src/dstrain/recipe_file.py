"""A recipe file read into a typed ``Recipe``: the YAML, the command line's ``key=value`` overrides, the model fields
filled from ``init_from``'s architecture (read by the caller: dstrain.checkpoint.model_source; no model file is read
here) and from the prepared data, each field's type and range (dstrain.typed_yaml), then the checks that span several
fields (dstrain.recipe_checks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.recipe_checks import validate
from dstrain.run_dir import LAUNCH_KEY
from dstrain.typed_yaml import apply_override, parse, read_yaml_file


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply ``key=value`` overrides, and validate everything. Its model section is taken as
    written (a run's recipe.yaml, resolved); a recipe whose init_from fills model fields it leaves out is read with
    dstrain.checkpoint.model_source.load_recipe_and_source."""
    return recipe_of(read_recipe(path, overrides), Path(path), None)


def read_recipe(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """A recipe file's YAML mapping with the ``key=value`` overrides applied, not yet typed."""
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
    return raw


def recipe_of(raw: dict, path: Path, init_model: dict | None) -> Recipe:
    """The typed, validated recipe of ``read_recipe``'s mapping; ``init_model``: init_from's architecture as model
    fields (None: none, or the model section is taken as written)."""
    if init_model is not None:
        fill_model_from_init_from(raw, init_model)
    fill_model_defaults(raw, path)
    recipe = parse(Recipe, raw, path, "")
    validate(recipe, path)
    return recipe


def refuse_moved_keys(raw: dict, path: Path) -> None:
    """model.activation_checkpointing, where nanoGPT-style recipes keep it, is a memory strategy: the ds_config's."""
    model = raw.get("model")
    if isinstance(model, dict) and "activation_checkpointing" in model:
        raise DstrainError(
            f"{path}: model.activation_checkpointing is a ds_config setting; remove it here and add "
            f'"activation_checkpointing": {{"partition_activations": false}} to your ds_config'
        )


def fill_model_from_init_from(raw: dict, init_model: dict) -> None:
    """With init_from, the model fields the recipe leaves out are its architecture's (``init_model``). Training choices
    (doc_masking) stay the recipe's; the fields it gives are checked against the source before any work
    (train/preflight.py), so a differing one is refused by name."""
    folder = {k: v for k, v in init_model.items() if k != "doc_masking"}
    given = raw.get("model") or {}
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
