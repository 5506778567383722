"""The trainer's seam for tests that inject faults into real runs (dstrain.train.step.steps and
dstrain.train.step.forward
call it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepHooks:
    """The trainer's seam for tests that inject faults into real runs (a poisoned sample, a NaN, an exception or a
    hang in the forward pass, a signal after a step); the trainer's own hooks are these, which change nothing.
    ``step``: the optimizer step being taken (1-based)."""

    def attach(self, engine) -> None:
        """The built engine, before the first step (dstrain doctor's probe instruments it here)."""

    def train_batch(self, samples: list[int], batch: dict) -> dict:
        """A micro-batch of the train stream on the device, and the train set's sample indices it holds."""
        return batch

    def forward(self, step: int, batch: dict, forward: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        """A micro-batch's loss, in training and evaluation: ``forward(batch)``."""
        return forward(batch)

    def stepped(self, step: int) -> None:
        """This rank's share of optimizer step ``step`` is done; the step's all-reduce comes next."""
