"""The steps no rollback mends: they stop the run with one line and keep the last checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

from dstrain.errors import DstrainError
from dstrain.precision import Precision
from dstrain.train.step.components import Component, StepOutcome, Verdict
from dstrain.train.step.handle import RunHandle


class FatalStepCheck(Component):
    """What no rollback mends: too many fp16 overflows in a row, or a loss that is not finite (fp32/bf16, with no
    spike guard to catch it). Either stops the run with one line; the last checkpoint is kept."""

    def __init__(self, engine, train, precision: Precision, checkpoints: Path) -> None:
        self.engine, self.max_skipped, self.precision, self.checkpoints = (
            engine,
            train.max_skipped_steps,
            precision,
            checkpoints,
        )
        self.last_skipped, self.consecutive_skips = engine.skipped_steps, 0

    def on_train_start(self) -> None:
        self.last_skipped, self.consecutive_skips = self.engine.skipped_steps, 0  # as the resumed checkpoint left it

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        self.check(outcome.step, outcome.loss)
        return Verdict.GO_ON

    def check(self, step: int, step_loss: float) -> None:
        skipped = self.engine.skipped_steps - self.last_skipped
        self.last_skipped = self.engine.skipped_steps
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > self.max_skipped:
            raise DstrainError(
                f"{self.consecutive_skips} consecutive fp16 overflow steps "
                f"(train.max_skipped_steps={self.max_skipped}); lower optim.lr or use a bf16 ds_config"
            )
        if not math.isfinite(step_loss) and self.precision != "fp16":
            raise DstrainError(
                f"loss became {step_loss} at step {step}; stopping, the last checkpoint in {self.checkpoints} is kept; "
                f"lower optim.lr or raise schedule.warmup_steps"
            )


def build(run: RunHandle) -> FatalStepCheck:
    return FatalStepCheck(run.engine, run.recipe.train, run.strategy.precision, run.files.checkpoints)
