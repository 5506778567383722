"""A model's forward as training, evaluation and scoring share it, under each layout: ZeRO and AutoTP engines
micro-batch by micro-batch, pipeline engines through ``eval_batch``, sequence parallelism with each rank holding a
slice of every sample and a share of its loss (dstrain.train.engine.sequence), a plain module for ``dstrain eval``
(``ModelForward.of_module``). dstrain.train.step.steps' training step drives it with the step's divisor (its module doc
says why the loss is divided so)."""

from __future__ import annotations

import torch

from dstrain.data.dataset import collate
from dstrain.model.gpt import soft_cap, token_loss_sum
from dstrain.tasks import scoring
from dstrain.train.engine import sequence, tiling
from dstrain.train.engine.build import is_pipeline, monitor_paused
from dstrain.train.step.components import Progress
from dstrain.train.step.step_hooks import StepHooks


class ModelForward:
    def __init__(
        self,
        engine,
        device,
        doc_masking: bool,
        progress: Progress,
        hooks: StepHooks,
        loss_tiles: int = 1,
        logit_softcap: float | None = None,
        micro_batch: int = 1,
        pipe_repeats: int = 1,
    ) -> None:
        """``engine``: DeepSpeed's engine, or a plain module; ``progress``, ``hooks``: the trainer's (the step a
        forward belongs to, a test's faults); ``micro_batch``: training's, the size a pipeline's p2p buffers are
        sized for; ``pipe_repeats``: how often a pipeline's eval runs one micro-batch (DualPipeV: 2 x stages)."""
        self.engine, self.device, self.doc_masking, self.progress, self.hooks = (
            engine,
            device,
            doc_masking,
            progress,
            hooks,
        )
        self.loss_tiles, self.logit_softcap = loss_tiles, logit_softcap
        self.pipeline = is_pipeline(engine)
        self.sp_size, self.sp_group, self.sp_rank = 1, None, 0  # sequence parallelism: of_engine sets them
        self.micro_batch = self.pipe_batch_size = micro_batch
        self.pipe_repeats = pipe_repeats
        self.divisor: float | None = None  # during a train step: its learned tokens per micro-batch (steps.py)

    @classmethod
    def of_engine(cls, recipe, strategy, engine, progress: Progress, hooks: StepHooks) -> ModelForward:
        """The trainer's: the engine of any strategy."""
        forward = cls(
            engine,
            engine.device,
            recipe.model.doc_masking,
            progress,
            hooks,
            loss_tiles=strategy.loss_tiles,
            logit_softcap=recipe.model.logit_softcap,  # the chunked pipeline head's (model.gpt.Head applies it)
            micro_batch=strategy.micro_batch,
            pipe_repeats=2 * strategy.pp_stages if strategy.pipe_schedule == "dualpipev" else 1,
        )
        forward.sp_size = strategy.sp_size
        forward.sp_group = engine.mpu.get_sequence_parallel_group() if strategy.sp_size > 1 else None
        forward.sp_rank = engine.mpu.get_sequence_parallel_rank() if strategy.sp_size > 1 else 0
        return forward

    @classmethod
    def of_module(cls, module: torch.nn.Module, device, doc_masking: bool) -> ModelForward:
        """Evaluation of a plain model (``dstrain eval``): no engine, nothing split, the same forward and sums."""
        return cls(module, device, doc_masking, Progress(), StepHooks())

    def to_device(self, samples: list[int], data) -> dict:
        batch = collate([data[i] for i in samples])
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

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
            self._resize_pipe(self.micro_batch)

    def forward_loss(self, batch: dict) -> torch.Tensor:
        return self.hooks.forward(self.progress.step + 1, batch, self._forward_loss)

    def _forward_loss(self, batch: dict) -> torch.Tensor:
        """The micro-batch's loss sum over its learned tokens divided by the step's learned tokens per micro-batch
        in a train step (module doc), else (evaluation) by its own: its mean. Under sequence parallelism this rank's
        share of it (the SP group's shares add up to the whole)."""
        if self.sp_group is not None:
            batch = sequence.shard(batch, self.sp_rank, self.sp_size, self.doc_masking)
        position_ids = batch["position_ids"] if self.sp_group is not None or self.doc_masking else None
        labels, tiles = batch["labels"], self.loss_tiles
        if tiles > 1:
            hidden = self.engine(batch["input_ids"], position_ids, head=False)
            head = self.engine.module.lm_head
            losses = tiling.tiled_loss_sum(head, hidden, labels, tiles)
        else:
            losses = token_loss_sum(self.engine(batch["input_ids"], position_ids), labels)
        if self.divisor is not None:
            return losses / self.divisor
        count = (labels != -100).sum().to(losses.dtype)
        if self.sp_group is not None:
            torch.distributed.all_reduce(count, group=self.sp_group)  # the tokens of the whole sample
        return losses / count.clamp(min=1)

    def pipe_item(self, batch: dict) -> tuple:
        """(inputs, labels) as the first and last pipeline stages take them."""
        inputs = (batch["input_ids"], batch["position_ids"]) if self.doc_masking else batch["input_ids"]
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
        repeats = self.pipe_repeats
        items = iter([self.pipe_item(batch)] * repeats)
        with monitor_paused(self.engine):
            losses = self.engine.eval_batch(items, num_micro_batches=repeats, reduce_output=None, bcast_loss=False)
        return None if losses is None else losses[0].item()

    # --- scoring downstream tasks (dstrain.tasks.scoring) ---------------------------------------------------------
    def new_score_length(self):
        """What scoring.evaluate calls when the rows' length changes: the pipeline re-sizes its p2p buffers."""
        return self.engine.reset_activation_shape if self.pipeline else None

    def score(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The scorer's statistics of a batch of rows (scoring.continuation_stats) over the whole model's logits.
        ZeRO (any stage), AutoTP, expert parallelism: the engine's forward gives them. Sequence parallelism: each
        rank scores its slice and the SP group adds the slices up. Pipeline: the last stage; None on the others."""
        if self.pipeline:
            return self._pipe_score(inputs, targets)
        if self.sp_group is not None:
            part = sequence.shard({"input_ids": inputs, "labels": targets}, self.sp_rank, self.sp_size, False)
            stats = self._score_stats(part["input_ids"], part["position_ids"], part["labels"])
            torch.distributed.all_reduce(stats, group=self.sp_group)  # the slices' sums make the sample's
            return stats
        return self._score_stats(inputs, None, targets)

    def _score_stats(self, inputs: torch.Tensor, position_ids, targets: torch.Tensor) -> torch.Tensor:
        """The scorer's statistics, chunk by chunk where the run's loss is chunked (ds_config "tiling.loss")."""
        if self.loss_tiles == 1:
            return scoring.continuation_stats(self.engine(inputs, position_ids), targets)
        hidden = self.engine(inputs, position_ids, head=False)
        return scoring.tiled_continuation_stats(self.engine.module.lm_head, hidden, targets, self.loss_tiles)

    def _pipe_stats(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's last stage: logits, or (hidden states, head weight) where the loss is chunked."""
        if isinstance(outputs, torch.Tensor):
            return scoring.continuation_stats(outputs, targets)
        hidden, weight = outputs

        def project(tile: torch.Tensor) -> torch.Tensor:
            return soft_cap(torch.nn.functional.linear(tile, weight), self.logit_softcap)

        return scoring.tiled_continuation_stats(project, hidden, targets, self.loss_tiles)

    def _pipe_score(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The pipeline's eval path with the scorer's statistics as its loss: the last stage returns them.
        DeepSpeed 0.19.8's PipelineEngine.eval_batch adds every output into ``total_loss``, which only train_batch
        resets: the valid loss's scalar and these (B, 2) rows would not add up, so it is emptied around each call."""
        engine = self.engine
        loss_fn, engine.module.loss_fn = engine.module.loss_fn, self._pipe_stats
        engine.total_loss = None
        try:
            with monitor_paused(engine):
                outputs = engine.eval_batch(
                    iter([(inputs, targets)]), num_micro_batches=1, reduce_output=None, bcast_loss=False
                )
        finally:
            engine.module.loss_fn, engine.total_loss = loss_fn, None
        return None if outputs is None else outputs[0]
