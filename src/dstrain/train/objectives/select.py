"""The training objective a recipe asks for, as the forward that computes its loss and the step that counts its
divisor: the language-model loss (ModelForward, TrainStep), or a ``preference:`` loss over pairs (PreferenceForward,
PreferenceStep, docs/preference-tuning.md)."""

from __future__ import annotations

from dstrain.train.objectives.preference.forward import PreferenceForward
from dstrain.train.objectives.preference.steps import PreferenceStep
from dstrain.train.step.forward import ModelForward
from dstrain.train.step.steps import TrainStep


def forward_and_step(recipe) -> tuple[type[ModelForward], type[TrainStep]]:
    """The classes the trainer builds its forward and its train step from."""
    if recipe.preference is not None:
        return PreferenceForward, PreferenceStep
    return ModelForward, TrainStep
