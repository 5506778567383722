"""The language-model loss (pretraining, SFT; dstrain.objectives.language_model): the shared forward and step of
dstrain.train.step, with no component or evaluation of its own."""

from __future__ import annotations

from dstrain.train.objectives.training import ObjectiveTraining
from dstrain.train.step.forward import ModelForward
from dstrain.train.step.steps import TrainStep

TRAINING = ObjectiveTraining(forward=ModelForward, step=TrainStep)
