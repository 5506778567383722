"""An objective's torch side, one record per objective (``ObjectiveTraining``): the forward that computes its loss,
the step that counts its divisor, the components it adds to a run (its metrics), and its own evaluation of a folder of
its data for `dstrain eval`. Each is the ``TRAINING`` of the module its torch-free record names
(dstrain.objectives.objective.Objective.training), so the registry of dstrain.objectives is the only list: the loop,
the features' assembly and the commands ask ``training_of``, never an objective by name."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dstrain.objectives.objective import Objective
from dstrain.objectives.registry import OBJECTIVES, objective_of

if TYPE_CHECKING:
    from dstrain.train.step.components import Component
    from dstrain.train.step.forward import ModelForward
    from dstrain.train.step.handle import RunHandle
    from dstrain.train.step.steps import TrainStep


@dataclass(frozen=True)
class ObjectiveTraining:
    """An objective's torch side (module doc)."""

    forward: type[ModelForward]  # built with of_engine(recipe, strategy, engine, progress, hooks)
    step: type[TrainStep]  # built with (recipe, strategy, engine, forward, components)
    # its components (metrics, passes before step 1), after the features' (dstrain.train.features.builders)
    components: tuple[Callable[[RunHandle], Component | None], ...] = ()
    # `dstrain eval MODEL --data FOLDER` of a folder of its data kinds: the printed result; None: the language-model
    # loss of the one evaluator (dstrain.commands.evaluate)
    evaluate: Callable[[argparse.Namespace], dict] | None = None


def training(objective: Objective) -> ObjectiveTraining:
    """The torch side of ``objective``: its module's TRAINING."""
    found = importlib.import_module(objective.training).TRAINING
    assert isinstance(found, ObjectiveTraining), f"{objective.training}.TRAINING is not an ObjectiveTraining"
    return found


def training_of(recipe) -> ObjectiveTraining:
    """The torch side of the objective ``recipe`` chooses."""
    return training(objective_of(recipe))


def evaluation_of(data_kind: str) -> Callable[[argparse.Namespace], dict] | None:
    """The evaluation of its own of the objective that trains on ``data_kind`` (None: the language-model loss)."""
    for objective in OBJECTIVES.values():
        if data_kind in objective.data_kinds and (evaluate := training(objective).evaluate) is not None:
            return evaluate
    return None
