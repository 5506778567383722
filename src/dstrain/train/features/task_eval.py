"""Downstream tasks at each evaluation (recipe ``train.tasks``): their accuracies join the ``valid`` record. The
scoring is dstrain.train.step.evaluator.Evaluator.tasks, the forward that of
dstrain.train.step.forward.ModelForward.score, so
the scorer sees the whole model's logits under every strategy, as ``dstrain eval --tasks`` does."""

from __future__ import annotations

from dstrain.tasks import scoring
from dstrain.train.step.components import Component
from dstrain.train.step.evaluator import Evaluator
from dstrain.train.step.handle import RunHandle


class TaskScores(Component):
    def __init__(self, engine, evaluator: Evaluator, tasks: list[scoring.PreparedTask]) -> None:
        self.engine, self.evaluator, self.tasks = engine, evaluator, tasks

    def valid_record_fields(self) -> dict:
        self.engine.eval()
        try:
            return self.evaluator.tasks(self.tasks)
        finally:
            self.engine.train()


def build(run: RunHandle) -> TaskScores | None:
    """The train.tasks' items (checked by the launch's check phase) as scoring requests, in the data's own
    tokenizer; None without train.tasks."""
    recipe = run.recipe
    if not recipe.train.tasks:
        return None
    from dstrain.data.tokenizer import load_tokenizer, run_tokenizer_dir
    from dstrain.errors import naming_files
    from dstrain.tasks.loading import load_tasks

    with naming_files(tasks="train.tasks"):  # checked at launch, under the recipe's name
        items = load_tasks(recipe.train.tasks)
    tokenizer = load_tokenizer(str(run_tokenizer_dir(recipe.data)), flag="data.tokenizer")
    return TaskScores(run.engine, run.evaluator, scoring.prepare(items, tokenizer, recipe.model.max_seq_len))
