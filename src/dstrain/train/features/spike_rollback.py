"""The spike guard as the trainer's component (recipe ``train.spike_guard``): it lowers the learning rate after a
rollback, watches each step's loss or gradient norm, and on a spike rolls the trainer back
(dstrain.train.features.spike_guard
describes the statistic and the rollback); its state travels in every checkpoint's client state."""

from __future__ import annotations

import math

import torch

from dstrain.checkpoint import store
from dstrain.errors import DstrainError
from dstrain.run_dir import step_of
from dstrain.train.features.spike_guard import SpikeGuard
from dstrain.train.step.components import Component, StepOutcome, Verdict
from dstrain.train.step.handle import RunHandle


class SpikeRollback(Component):
    state_key = "spike_guard"

    def __init__(self, run: RunHandle, guard: SpikeGuard) -> None:
        """``run``: the trainer, whose restore, save and log a rollback uses."""
        self.trainer, self.guard = run, guard

    def lr_scale(self, step: int) -> float:
        return self.guard.lr_scale(step)

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        metric = outcome.grad_norm if self.guard.config.metric == "grad_norm" else outcome.loss
        # fp16: an overflow's inf is the loss scaler's business, not a spike.
        if not math.isfinite(metric) and self.trainer.strategy.precision == "fp16":
            return Verdict.GO_ON
        limit = self.guard.observe(metric)
        return Verdict.UNDONE if limit is not None and self.roll_back(metric, limit) else Verdict.GO_ON

    def state_dict(self) -> dict:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.guard.load_state_dict(state)

    def roll_back(self, value: float, limit: float) -> bool:
        """Every rank: reload the newest complete checkpoint, skip the data since it, log the event (True); with no
        checkpoint yet, log the event and go on (False); after too many spikes, stop with one line.
        The trainer has just taken the spiking step (dstrain.train.features.spike_guard describes the rollback)."""
        trainer, guard = self.trainer, self.guard
        config = guard.config
        spike_step, spike_samples = trainer.progress.step, trainer.progress.consumed_samples
        median = limit / config.factor
        checkpoints = trainer.files.checkpoints
        trainer.components.on_phase("rollback", spike_step)
        trainer.finish_pending_save()  # a background write of an earlier step publishes first
        if guard.too_many(spike_step):
            raise DstrainError(
                f"{config.metric} spike at step {spike_step} ({value:.4g} > {config.factor:g} x median {median:.4g}): "
                f"more than train.spike_guard.max_rollbacks={config.max_rollbacks} within {config.rollback_window} "
                f"steps; stopping, the checkpoints in {checkpoints} are kept; lower optim.lr or inspect the data"
            )
        # One decision for all ranks: rank 0's reading of the checkpoint folder.
        found = [store.newest_complete(checkpoints) if trainer.is_rank0 else None]
        torch.distributed.broadcast_object_list(found, src=0)
        tag = found[0]
        event = {"event": "spike", "spike_step": spike_step, "metric": config.metric, "value": value}
        event.update(median=median, threshold=limit, rolled_back_to=tag)
        if tag is None:
            trainer.log.write({"step": spike_step, **event, "skipped_samples": None})
            trainer.log.note(
                f"{config.metric} spike at step {spike_step} ({value:.4g} > {limit:.4g}); no checkpoint yet"
            )
            return False
        spikes, skipped = guard.spikes, guard.skipped
        state = trainer.restore(tag)  # weights, optimizer, schedule, RNG, consumed_samples and the guard of `tag`
        first = state.consumed_samples
        guard.spikes, guard.skipped = spikes, [*skipped, [first, spike_samples]]
        guard.lr_until = trainer.progress.step + config.lr_steps
        trainer.progress.consumed_samples = spike_samples
        trainer.log.drop_after(trainer.progress.step)
        assert step_of(tag) == trainer.progress.step
        trainer.save()  # the same step again, now holding the skip: a requeued job never reads the window
        # Logged once it is durable: a job killed after this line never trains on the window again.
        trainer.log.write({"step": trainer.progress.step, **event, "skipped_samples": [first, spike_samples]})
        batches = (spike_samples - first) // trainer.recipe.train.global_batch
        trainer.log.note(
            f"{config.metric} spike at step {spike_step} ({value:.4g} > {config.factor:g} x median {median:.4g}): "
            f"rolled back to {tag}, skipping samples {first}-{spike_samples - 1} "
            f"({batches} global batch{'es' if batches > 1 else ''})"
            + (f", lr x {config.lr_factor:g} until step {guard.lr_until}" if config.lr_steps else "")
        )
        return True


def build(run: RunHandle) -> SpikeRollback | None:
    config = run.recipe.train.spike_guard
    return SpikeRollback(run, SpikeGuard(config)) if config.enabled else None
