"""Early stopping on the valid loss (recipe ``train.early_stop``): after ``patience`` evaluations in a row whose
``valid`` loss is not below the best by more than ``min_delta``, the run stops cleanly (a checkpoint, summary.json
with status "stopped"). Every rank reads the same valid loss (the evaluator's all-reduce), so every rank stops at the
same step. The best loss and the count travel in each checkpoint, so a resumed run goes on counting."""

from __future__ import annotations

import math

from dstrain.config import EarlyStopConfig
from dstrain.train.step.components import Component, Verdict
from dstrain.train.step.handle import RunHandle


class EarlyStop(Component):
    state_key = "early_stop"

    def __init__(self, config: EarlyStopConfig, run: RunHandle) -> None:
        self.config, self.run = config, run
        self.best, self.evals_since_best = math.inf, 0

    def on_eval_end(self, records: list[dict]) -> Verdict:
        loss = next(record["loss"] for record in records if record["split"] == "valid")
        if loss < self.best - self.config.min_delta:
            self.best, self.evals_since_best = loss, 0
            return Verdict.GO_ON
        self.evals_since_best += 1
        if self.evals_since_best < self.config.patience:
            return Verdict.GO_ON
        step = self.run.progress.step
        self.run.log.write({"step": step, "event": "early_stop", "best_loss": self.best, "loss": loss})
        self.run.log.note(
            f"early stop at step {step}: valid loss {loss:.4f}, no better than {self.best:.4f} - "
            f"{self.config.min_delta:g} for {self.evals_since_best} evaluations (train.early_stop.patience)"
        )
        return Verdict.STOP

    def state_dict(self) -> dict:
        return {"best": self.best, "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:  # None: the run that saved it had no early stop
            self.best, self.evals_since_best = state["best"], state["evals_since_best"]


def build(run: RunHandle) -> EarlyStop | None:
    config = run.recipe.train.early_stop
    return EarlyStop(config, run) if config.patience else None
