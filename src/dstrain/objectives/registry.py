"""Every training objective, by name: the one place that lists them. The recipe's objective is the one whose section
it sets (``objective_of``), else the default; the launch's checks, the strategy and the planner ask the registry, never
an objective by name. A new objective is one line here (dstrain.objectives.objective's module doc)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstrain.errors import DstrainError
from dstrain.objectives import language_model, online_rl, preference
from dstrain.objectives.objective import DATA_KINDS, Objective

if TYPE_CHECKING:
    from dstrain.config import Recipe
    from dstrain.data.manifest import Manifest

DEFAULT = language_model.OBJECTIVE
OBJECTIVES: dict[str, Objective] = {
    objective.name: objective
    for objective in (
        language_model.OBJECTIVE,  # pretraining and SFT: the default
        preference.OBJECTIVE,  # preference:, DPO and its variants
        online_rl.OBJECTIVE,  # rl:, GRPO and its variants
    )
}


def objective_of(recipe: Recipe) -> Objective:
    """The objective a recipe chooses: the one whose section it sets, else the default (a recipe setting two
    sections is refused by dstrain.recipe_checks, through ``check_one_objective``)."""
    return next((o for o in OBJECTIVES.values() if o.chosen(recipe)), DEFAULT)


def check_one_objective(recipe: Recipe, file: object) -> None:
    """At most one objective's section is set."""
    sections = [o.section for o in OBJECTIVES.values() if o.chosen(recipe)]
    if len(sections) > 1:
        raise DstrainError(
            f"{file}: {sections[0]}: and {sections[1]}: each choose a training objective; keep one of the sections"
        )


def check_data(recipe: Recipe, manifests: list[Manifest], recipe_file: str) -> None:
    """The recipe's objective's own checks, then every source of data it trains on (a folder of a kind only another
    objective trains on is refused naming how to choose that one)."""
    objective = objective_of(recipe)
    objective.check(recipe, manifests, recipe_file)
    for source, manifest in zip(recipe.data.sources, manifests):
        if manifest.kind in objective.data_kinds:
            continue
        takers = [o.chosen_by for o in OBJECTIVES.values() if manifest.kind in o.data_kinds]
        raise DstrainError(
            f"{recipe_file}: data.sources {source.path} holds {DATA_KINDS[manifest.kind]}, which train only under "
            f"{' or '.join(takers) or 'no objective'}"
        )
