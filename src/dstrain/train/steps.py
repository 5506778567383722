"""How a batch goes through the engine under each layout: ZeRO and AutoTP engines micro-batch by micro-batch,
pipeline engines a whole optimizer step at a time (``train_batch``/``eval_batch``), sequence parallelism with each
rank holding a slice of every sample and a share of its loss (dstrain.train.sequence). The trainer
(dstrain.train.loop) decides which samples and when; this module only moves them through the engine.

The step's loss is the sum of the token losses over the global batch's learned tokens (labels not -100) divided by
their count over all ranks and micro-batches: not a mean of per-micro-batch or per-rank means, which would weight
the tokens of a micro-batch with few learned tokens (short answers) more. Each micro-batch's loss sum is divided by
the step's learned tokens per micro-batch, N / (dp x accumulation): DeepSpeed's backward divides by the accumulation
steps and its all-reduce averages over the data-parallel ranks, so the gradient formed is that of the sum over N.
For text every micro-batch learns all its tokens and this is the plain mean, as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dstrain.data.dataset import collate
from dstrain.model.gpt import token_loss_sum
from dstrain.train import sequence, tiling
from dstrain.train.engine import is_pipeline, monitor_paused


class StepHooks:
    """The trainer's seam for tests that inject faults into real runs (a poisoned sample, a NaN, an exception or a
    hang in the forward pass, a signal after a step); the trainer's own hooks are these, which change nothing.
    ``step``: the optimizer step being taken (1-based)."""

    def train_batch(self, samples: list[int], batch: dict) -> dict:
        """A micro-batch of the train stream on the device, and the train set's sample indices it holds."""
        return batch

    def forward(self, step: int, batch: dict, forward: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        """A micro-batch's loss, in training and evaluation: ``forward(batch)``."""
        return forward(batch)

    def stepped(self, step: int) -> None:
        """This rank's share of optimizer step ``step`` is done; the step's all-reduce comes next."""


class StepRunner:
    def __init__(self, recipe, strategy, engine, progress, hooks: StepHooks, moe, watch) -> None:
        """``progress``: the trainer's (dstrain.train.loop.Progress); ``moe``, ``watch``: its MoE meter and
        watchdog."""
        self.recipe, self.strategy, self.engine, self.progress = recipe, strategy, engine, progress
        self.hooks, self.moe, self.watch = hooks, moe, watch
        self.device = engine.device
        self.pipeline = is_pipeline(engine)
        self.sp_size = strategy.sp_size
        self.sp_group = engine.mpu.get_sequence_parallel_group() if self.sp_size > 1 else None
        self.sp_rank = engine.mpu.get_sequence_parallel_rank() if self.sp_size > 1 else 0
        self.backward_factor = sequence.backward_factor(strategy.zero_stage, self.sp_size)
        self.pipe_batch_size = strategy.micro_batch  # the micro-batch size the pipeline's p2p buffers are sized for
        self.divisor: float | None = None  # during a train step: its learned tokens per micro-batch (module doc)
        self.learned_tokens = 0  # the last train step's learned tokens, over the global batch
        self.world = torch.distributed.get_world_size()

    def to_device(self, samples: list[int], data) -> dict:
        batch = collate([data[i] for i in samples])
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

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
        self.watch.mark("counting the step's learned tokens")
        local = sum((batch["labels"] != -100).sum() for batch in micro_batches)
        count = torch.as_tensor(local, device=self.device, dtype=torch.float64)
        torch.distributed.all_reduce(count)
        self.learned_tokens = round(count.item() * self.strategy.dp_size / self.world)
        self._set_divisor(max(count.item(), 1.0) / (self.world * self.strategy.grad_accum))

    def _set_divisor(self, divisor: float | None) -> None:
        self.divisor = divisor
        if self.pipeline:
            self.engine.module.loss_fn.divisor = divisor

    def _train_micro_batches(self, micro_batches: list[dict]) -> torch.Tensor:
        if self.pipeline:
            # One optimizer step; returns the data-parallel mean loss on every stage.
            return self.engine.train_batch(iter([self._pipe_item(batch) for batch in micro_batches]))
        total = torch.zeros((), device=self.device)
        for micro, batch in enumerate(micro_batches):
            self.watch.mark(f"forward {micro}")
            loss = self.forward_loss(batch)  # the LM loss, what is logged and compared
            self.watch.mark(f"backward {micro}")
            objective = loss + self.moe.losses() if self.moe.enabled else loss
            self.engine.backward(objective * self.backward_factor if self.backward_factor != 1.0 else objective)
            self.watch.mark(f"optimizer step {micro}")
            self.engine.step()
            total += loss.detach().float()
        return total / self.strategy.grad_accum

    def step_loss(self, summed: float, world: int) -> float:
        """The step's mean loss from the sum over all ranks of ``train_step``'s: SP ranks hold shares of their
        replica's loss."""
        return summed * self.sp_size / world

    def eval_loss(self, batch: dict) -> float | None:
        """A micro-batch's mean loss (under SP this rank's share of it); None on a pipeline stage but the last."""
        return self._pipe_eval_loss(batch) if self.pipeline else self.forward_loss(batch).item()

    def eval_sums(self, loss: float, tokens: int) -> torch.Tensor:
        """(loss x tokens, tokens) of a micro-batch's ``eval_loss`` and its learned tokens: an SP group's ranks add
        up to its whole."""
        return torch.tensor([loss * tokens, tokens / self.sp_size], device=self.device, dtype=torch.float64)

    def end_eval(self) -> None:
        """The pipeline's p2p buffers sized for training's micro-batches again."""
        if self.pipeline:
            self._resize_pipe(self.strategy.micro_batch)

    def forward_loss(self, batch: dict) -> torch.Tensor:
        return self.hooks.forward(self.progress.step + 1, batch, self._forward_loss)

    def _forward_loss(self, batch: dict) -> torch.Tensor:
        """The micro-batch's loss sum over its learned tokens divided by the step's learned tokens per micro-batch
        in a train step (module doc), else (evaluation) by its own: its mean. Under sequence parallelism this rank's
        share of it (the SP group's shares add up to the whole)."""
        if self.sp_group is not None:
            batch = sequence.shard(batch, self.sp_rank, self.sp_size, self.recipe.model.doc_masking)
        position_ids = batch["position_ids"] if self.sp_group is not None or self.recipe.model.doc_masking else None
        labels, tiles = batch["labels"], self.strategy.loss_tiles
        if tiles > 1:
            hidden = self.engine(batch["input_ids"], position_ids, head=False)
            head = self.engine.module.lm_head
            losses = tiling.tiled_loss_sum(head, head.weight, hidden, labels, tiles, self.recipe.model.tied)
        else:
            losses = token_loss_sum(self.engine(batch["input_ids"], position_ids), labels)
        if self.divisor is not None:
            return losses / self.divisor
        count = (labels != -100).sum().to(losses.dtype)
        if self.sp_group is not None:
            torch.distributed.all_reduce(count, group=self.sp_group)  # the tokens of the whole sample
        return losses / count.clamp(min=1)

    def _pipe_item(self, batch: dict) -> tuple:
        """(inputs, labels) as the first and last pipeline stages take them."""
        inputs = (batch["input_ids"], batch["position_ids"]) if self.recipe.model.doc_masking else batch["input_ids"]
        return inputs, batch["labels"]

    def _resize_pipe(self, size: int) -> None:
        """The pipeline sizes its p2p buffers by the first micro-batch it sends; a different size needs new ones."""
        if size != self.pipe_batch_size:
            self.engine.reset_activation_shape()
            self.pipe_batch_size = size

    def _pipe_eval_loss(self, batch: dict) -> float | None:
        """One micro-batch through the pipeline; its mean loss on the last stage, None on the others."""
        self._resize_pipe(batch["labels"].shape[0])
        # DualPipeV runs no fewer than 2 x stages micro-batches (DeepSpeed's DualPipeVSchedule): the same one
        # repeated, its first loss kept.
        repeats = 2 * self.strategy.pp_stages if self.strategy.pipe_schedule == "dualpipev" else 1
        items = iter([self._pipe_item(batch)] * repeats)
        with monitor_paused(self.engine):
            losses = self.engine.eval_batch(items, num_micro_batches=repeats, reduce_output=None, bcast_loss=False)
        return None if losses is None else losses[0].item()
