"""Preference tuning (a recipe's preference:; dstrain.objectives.preference): the losses, the forward, the step, the
reference scores and their component, and `dstrain eval` of a pair folder."""

from __future__ import annotations

from dstrain.train.objectives.preference import evaluate, steps
from dstrain.train.objectives.preference.forward import PreferenceForward
from dstrain.train.objectives.training import ObjectiveTraining

TRAINING = ObjectiveTraining(
    forward=PreferenceForward,
    step=steps.PreferenceStep,
    components=(steps.build,),  # the reference scores (before step 1) and the reward metrics
    evaluate=evaluate.evaluate_pairs,
)
