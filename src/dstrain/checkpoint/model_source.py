"""Where a run's first weights come from, as one typed value resolved once at launch from the recipe's ``init_from``:
a dstrain run (``RunSource``: its newest intact checkpoint, the model its recipe resolved, its tokenizer), a Hugging
Face model folder (``HFFolderSource``: config.json, its weights, its tokenizer files), or nothing (None).

The recipe itself loads without reading model files (dstrain.recipe_file): ``load_recipe_and_source`` asks once
whether init_from is a run, and hands its architecture to the recipe as the model fields the recipe leaves out. The
launch's checks (dstrain.train.preflight), the weights' load (dstrain.train.engine.build.load_init_from) and the
objectives that score against init_from take the resolved source, never the path again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.errors import DstrainError
from dstrain.recipe_file import read_recipe, recipe_of
from dstrain.run_dir import RunDir

if TYPE_CHECKING:
    import torch

    from dstrain.config import Recipe
    from dstrain.model.config import GPTConfig


@dataclass(frozen=True)
class RunSource:
    """init_from names a dstrain run: its newest intact checkpoint, of the model its recipe resolved."""

    init_from: str  # as the recipe wrote it
    run: RunDir

    @property
    def tokenizer_folder(self) -> Path:
        return self.run.tokenizer  # copied at the run's start

    def architecture(self, needed: bool = True) -> GPTConfig:
        """The model the run's recipe resolved (its recipe.yaml; no checkpoint read)."""
        from dstrain.recipe_file import load_recipe

        return load_recipe(self.run.recipe).model

    def checked_architecture(self) -> GPTConfig:
        """The model of the run's newest intact checkpoint, refused in one line where it has none."""
        from dstrain.checkpoint.consolidate import load_run

        return load_run(self.run, None)[0].model

    def weights(self) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
        """(its model, the fp32 state dict of its newest intact checkpoint, whatever strategy wrote it)."""
        from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run

        recipe, tag_dir = load_run(self.run, None)
        return recipe.model, consolidated_state_dict(tag_dir, recipe.model)


@dataclass(frozen=True)
class HFFolderSource:
    """init_from names a Hugging Face model folder (save_pretrained's, or dstrain export's)."""

    init_from: str  # as the recipe wrote it
    folder: Path

    @property
    def tokenizer_folder(self) -> Path:
        return self.folder

    def architecture(self, needed: bool = True) -> GPTConfig | None:
        """config.json's model (no weights read); None where it is not ``needed`` and the folder has none yet (a
        shipped recipe on a machine without the weights: its model section is written out, and the launch's check
        refuses the folder)."""
        if not needed and not (self.folder / "config.json").is_file():
            return None
        from dstrain.model.hf.convert import architecture_from_hf  # torch and transformers: only with init_from

        return architecture_from_hf(self.folder)

    def checked_architecture(self) -> GPTConfig:
        """config.json's model, refused in one line where the folder holds no weights dstrain loads."""
        from dstrain.model.hf.convert import config_from_hf

        return config_from_hf(self.folder)

    def weights(self) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
        """(its model, its weights in fp32)."""
        from dstrain.model.hf.convert import from_hf

        config, state = from_hf(self.folder)
        return config, {k: v.float() for k, v in state.items()}


ModelSource = RunSource | HFFolderSource


def model_source(init_from: str | os.PathLike) -> ModelSource:
    """What ``init_from`` names: the one place that asks whether it is a run (a folder with recipe.yaml)."""
    run = RunDir.find(init_from)
    return RunSource(str(init_from), run) if run else HFFolderSource(str(init_from), Path(init_from))


def load_recipe_and_source(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Recipe, ModelSource | None]:
    """The recipe, with the model fields it leaves out filled from init_from's architecture, and init_from resolved
    (None without one). The fields it gives are checked against the source before any work (train/preflight.py)."""
    raw = read_recipe(path, overrides)
    init_from = raw.get("init_from")
    source = model_source(init_from) if isinstance(init_from, str) else None
    architecture = None
    if source is not None and isinstance(raw.get("model"), (dict, type(None))):
        try:
            architecture = source.architecture(needed=not raw.get("model"))
        except DstrainError as e:
            raise DstrainError(f"{path}: init_from: {e}") from None
    fields = dataclasses.asdict(architecture) if architecture is not None else None
    return recipe_of(raw, Path(path), fields), source


def load_recipe_to_size(path: str | Path, overrides: Sequence[str], purpose: str) -> Recipe:
    """The recipe as ``load_recipe_and_source`` reads it, for what sizes a run without reading its data (dstrain
    estimate, plan): a refusal for want of the prepared data's manifest also names the override that does without it;
    ``purpose``: "estimate", "plan"."""
    try:
        return load_recipe_and_source(path, overrides)[0]
    except DstrainError as e:
        hint = f"; to {purpose} without the data, pass model.vocab_size=<size>" if "manifest" in str(e) else ""
        raise DstrainError(f"{e}{hint}") from None
