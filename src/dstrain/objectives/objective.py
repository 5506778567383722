"""One record per training objective: everything the torch-free layers (the recipe's checks, the strategy, the planner,
the launch's checks) need to know of it, so that none of them names an objective. The torch side of each (its
forward, step, metrics component, evaluation) is the module ``Objective.training`` names, built by
dstrain.train.objectives.training.

A new objective: its spec module here (an ``Objective``), its folder dstrain/train/objectives/<name>/ (whose
``__init__`` defines ``TRAINING``), one line in dstrain.objectives.registry, and, when it has settings, its section's
field in dstrain.config.Recipe. See docs/architecture.md, "Objectives".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dstrain.config import Recipe
    from dstrain.data.manifest import Manifest

# The layouts an objective may refuse (``Objective.refuses``'s keys), as dstrain.strategy names them.
LAYOUTS = ("pipeline", "tensor", "sequence", "loss_tiling")
# The kinds of prepared data (dstrain.data.manifest.Manifest.kind) an objective may train on, and how a refusal of
# a folder of that kind names what it holds.
DATA_KINDS = {
    "text": "text (no loss mask)",
    "chat": "conversations with a loss mask (prepared with --chat)",
    "pairs": "preference pairs (chosen/rejected)",
}


@dataclass(frozen=True)
class PassBeforeTraining:
    """An objective's memory term: a pass of the built engine's no-grad forwards before step 1, beside the training
    state at rest (the preference objective's reference scores). dstrain.plan.memory counts it as a phase of its own
    ("reference") and `dstrain plan` prints its time."""

    what: str  # the estimate's line for its transient part
    formula: str  # that part's formula, as the estimate prints it
    # the transient peak of one forward on one rank, in bytes: (recipe, micro_batch, sp_size, activation bytes)
    transient_bytes: Callable[[Recipe, int, int, int], int]


def no_check(recipe: Recipe, manifests: list[Manifest], recipe_file: str) -> None:
    """An objective without checks of its own."""


def no_pass(recipe: Recipe) -> PassBeforeTraining | None:
    """An objective without a pass before step 1."""
    return None


@dataclass(frozen=True)
class Objective:
    """What a training objective is to the torch-free layers (module doc)."""

    name: str  # its key in dstrain.objectives.registry.OBJECTIVES, and its folder in dstrain/train/objectives/
    training: str  # the module of its torch side, defining TRAINING (dstrain.train.objectives.training)
    # the recipe's section that chooses it (dstrain.config.Recipe's field of that name set); None: the default
    # objective, chosen when no other objective's section is set
    section: str | None
    data_kinds: frozenset[str]  # the prepared data it trains on (DATA_KINDS' keys); a source of another is refused
    chosen_by: str  # how a recipe chooses it, for a refusal of data it alone trains on
    # its checks of the recipe against its prepared data, one line naming the recipe file, the key and the fix
    check: Callable[[Recipe, list[Manifest], str], None] = no_check
    # LAYOUTS' layouts it cannot run under -> the rest of the refusal's line (why, and the fix)
    refuses: Mapping[str, str] = field(default_factory=dict)
    memory: Callable[[Recipe], PassBeforeTraining | None] = no_pass  # its memory term for estimate and plan

    def chosen(self, recipe: Recipe) -> bool:
        """The recipe sets this objective's section (the default objective is chosen by the registry)."""
        return self.section is not None and getattr(recipe, self.section, None) is not None
