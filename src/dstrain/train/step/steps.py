"""The training step under each layout: ZeRO and AutoTP engines micro-batch by micro-batch (the forward:
dstrain.train.step.forward.ModelForward), pipeline engines a whole optimizer step at a time (``train_batch``). The
trainer
(dstrain.train.loop) decides which samples and when; this module only moves them through the engine.

The step's loss is the sum of the token losses over the global batch's learned tokens (labels not -100) divided by
their count over all ranks and micro-batches: not a mean of per-micro-batch or per-rank means, which would weight
the tokens of a micro-batch with few learned tokens (short answers) more. Each micro-batch's loss sum is divided by
the step's learned tokens per micro-batch, N / (dp x accumulation): DeepSpeed's backward divides by the accumulation
steps and its all-reduce averages over the data-parallel ranks, so the gradient formed is that of the sum over N.
For text every micro-batch learns all its tokens and this is the plain mean, as before."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dstrain.train.engine import sequence
from dstrain.train.step.components import Component
from dstrain.train.step.forward import ModelForward


class TrainStep:
    """One optimizer step: this rank's micro-batches of a global batch forward (through ``ModelForward``) and
    backward, the step's learned tokens counted and each micro-batch's loss divided by them."""

    def __init__(self, recipe, strategy, engine, forward: ModelForward, components: Component) -> None:
        """``components``: the trainer's (dstrain.train.step.components.Components), told where a step is and asked for
        the objective."""
        self.strategy, self.engine, self.forward, self.components = strategy, engine, forward, components
        self.device = engine.device
        self.sft = recipe.data.sft  # only --chat data has labels it does not learn (dstrain.data.dataset.collate)
        self.pipeline = forward.pipeline
        self.backward_factor = sequence.backward_factor(strategy.zero_stage, strategy.sp_size)
        self.learned_tokens = 0  # the last train step's learned tokens, over the global batch
        self.world = torch.distributed.get_world_size()

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        """Forward/backward over this rank's micro-batches of one global batch; returns the mean loss."""
        micro_batches = [next(batches) for _ in range(self.strategy.grad_accum)]
        self._count_learned(micro_batches)
        try:
            return self._train_micro_batches(micro_batches)
        finally:
            self._set_divisor(None)

    def _count_learned(self, micro_batches: list[dict]) -> None:
        """The step's learned tokens over all ranks, and the divisor of each micro-batch's loss sum (module doc).
        Every rank of a replica (its tensor, pipeline and sequence-parallel ranks) holds the same micro-batches, so
        the sum over the world counts each replica world / dp times."""
        if not self.sft:  # text learns every label, and every rank's micro-batches are one size: no collective
            tokens = sum(batch["labels"].numel() for batch in micro_batches)
            self.learned_tokens = tokens * self.strategy.dp_size
            self._set_divisor(tokens / self.strategy.grad_accum)
            return
        self.components.on_mark("counting the step's learned tokens")
        local = sum((batch["labels"] != -100).sum() for batch in micro_batches)
        count = torch.as_tensor(local, device=self.device, dtype=torch.float64)
        torch.distributed.all_reduce(count)
        self.learned_tokens = round(count.item() * self.strategy.dp_size / self.world)
        self._set_divisor(max(count.item(), 1.0) / (self.world * self.strategy.grad_accum))

    def _set_divisor(self, divisor: float | None) -> None:
        self.forward.divisor = divisor
        if self.pipeline:
            self.engine.module.loss_fn.divisor = divisor

    def _train_micro_batches(self, micro_batches: list[dict]) -> torch.Tensor:
        if self.pipeline:
            # One optimizer step; returns the data-parallel mean loss on every stage.
            return self.engine.train_batch(iter([self.forward.pipe_item(batch) for batch in micro_batches]))
        total = torch.zeros((), device=self.device)
        for micro, batch in enumerate(micro_batches):
            self.components.on_mark(f"forward {micro}")
            loss = self.forward.forward_loss(batch)  # the LM loss, what is logged and compared
            self.components.on_mark(f"backward {micro}")
            objective = self.components.objective(loss)
            self.engine.backward(objective * self.backward_factor if self.backward_factor != 1.0 else objective)
            self.components.on_mark(f"optimizer step {micro}")
            self.engine.step()
            total += loss.detach().float()
        return total / self.strategy.grad_accum

    def step_loss(self, summed: float, world: int) -> float:
        """The step's mean loss from the sum over all ranks of ``train_step``'s: SP ranks hold shares of their
        replica's loss."""
        return summed * self.strategy.sp_size / world
