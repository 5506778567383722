"""Downstream tasks at each evaluation: dstrain.tasks.scoring driven through the training engine, so that the
scorer sees the whole model's logits under every strategy. ZeRO (any stage), AutoTP and expert parallelism: the
engine's forward gives them. Sequence parallelism: each rank scores its slice and the SP group adds the slices up.
Pipeline: the engine's eval path (``eval_batch``), with the scorer's statistics as the loss function, hands them to
the last stage; the other stages add nothing to the gathered table. Where the run's loss is chunked, so is the
scorer's head (scoring.tiled_continuation_stats)."""

from __future__ import annotations

import torch

from dstrain.tasks import scoring
from dstrain.train import sequence
from dstrain.train.engine import monitor_paused


class TaskEvaluator:
    def __init__(self, trainer, tasks: list[scoring.PreparedTask]) -> None:
        self.trainer, self.tasks = trainer, tasks
        strategy = trainer.strategy
        self.layout = scoring.Layout(
            replica=trainer.dp_rank,
            replicas=strategy.dp_size,
            micro=strategy.micro_batch,
            max_len=trainer.recipe.model.max_seq_len,
            device=trainer.device,
            multiple_of=trainer.steps.sp_size,
        )

    def evaluate(self) -> dict:
        """``task/<name>/acc``, ``acc_norm``, ``samples`` of every task, and ``tasks_s``; a collective."""
        engine = self.trainer.engine
        engine.eval()
        reset = engine.reset_activation_shape if self.trainer.steps.pipeline else None
        try:
            return scoring.evaluate(self.tasks, self._forward, self.layout, new_length=reset)
        finally:
            if reset is not None:
                reset()  # the next train_batch sends its own shapes again
            engine.train()

    def _forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        steps = self.trainer.steps
        if steps.pipeline:
            return self._pipe_forward(inputs, targets)
        if steps.sp_group is not None:
            part = sequence.shard({"input_ids": inputs, "labels": targets}, steps.sp_rank, steps.sp_size, False)
            stats = self._stats(part["input_ids"], part["position_ids"], part["labels"])
            torch.distributed.all_reduce(stats, group=steps.sp_group)  # the slices' sums make the sample's
            return stats
        return self._stats(inputs, None, targets)

    def _stats(self, inputs: torch.Tensor, position_ids: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
        """The scorer's statistics, chunk by chunk where the run's loss is chunked (ds_config "tiling.loss")."""
        engine, tiles = self.trainer.engine, self.trainer.strategy.loss_tiles
        if tiles == 1:
            return scoring.continuation_stats(engine(inputs, position_ids), targets)
        hidden = engine(inputs, position_ids, head=False)
        return scoring.tiled_continuation_stats(engine.module.lm_head, hidden, targets, tiles)

    def _pipe_stats(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's last stage: logits, or (hidden states, head weight) where the loss is chunked."""
        if isinstance(outputs, torch.Tensor):
            return scoring.continuation_stats(outputs, targets)
        hidden, weight = outputs
        project = lambda tile: torch.nn.functional.linear(tile, weight)  # noqa: E731
        return scoring.tiled_continuation_stats(project, hidden, targets, self.trainer.strategy.loss_tiles)

    def _pipe_forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The pipeline's eval path with the scorer's statistics as its loss: the last stage returns them.
        DeepSpeed 0.19.8's PipelineEngine.eval_batch adds every output into ``total_loss``, which only train_batch
        resets: the valid loss's scalar and these (B, 2) rows would not add up, so it is emptied around each call."""
        engine = self.trainer.engine
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
