"""Downstream tasks at each evaluation (recipe ``train.tasks``): their accuracies join the ``valid`` record. The
scoring is dstrain.train.evaluator.Evaluator.tasks, the forward that of dstrain.train.steps.StepRunner.score, so
the scorer sees the whole model's logits under every strategy, as ``dstrain eval --tasks`` does."""

from __future__ import annotations

from dstrain.tasks import scoring
from dstrain.train.components import Component
from dstrain.train.evaluator import Evaluator


class TaskScores(Component):
    def __init__(self, engine, evaluator: Evaluator, tasks: list[scoring.PreparedTask]) -> None:
        self.engine, self.evaluator, self.tasks = engine, evaluator, tasks

    def valid_record_fields(self) -> dict:
        self.engine.eval()
        try:
            return self.evaluator.tasks(self.tasks)
        finally:
            self.engine.train()
