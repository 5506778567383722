"""Where a run's components are assembled (dstrain.train.components): one line per feature, in the order the loop
calls them. A new feature of the trainer is a Component subclass and one line here; the loop does not change.

The order matters where components act on one step: the averager takes in the step's weights before the spike guard
may roll them back, and the fatal-step check sees only a step that was not undone."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from dstrain.train.averaging import WeightAverager
from dstrain.train.components import Component
from dstrain.train.fatal_steps import FatalStepCheck
from dstrain.train.mixture import MixtureShares
from dstrain.train.moe_metrics import MoEMeter
from dstrain.train.preference_steps import PreferenceMetrics, reference_pass
from dstrain.train.spike_guard import SpikeGuard
from dstrain.train.spike_rollback import SpikeRollback
from dstrain.train.task_eval import TaskScores
from dstrain.train.watchdog import HangEvent, Watchdog


def assemble(trainer, tasks: list) -> list[Component]:
    """The components of ``trainer`` (dstrain.train.loop.Trainer, not yet running); ``tasks``: the train.tasks,
    prepared. A feature that is off is a plain Component, which does nothing."""
    recipe, strategy, engine, t = trainer.recipe, trainer.strategy, trainer.engine, trainer.recipe.train
    backend = get_accelerator().communication_backend_name()
    watchdog = Watchdog(t.watchdog, trainer.files, trainer.rank, trainer.world, backend) if t.watchdog.enabled else None
    return [
        watchdog or Component(),
        MoEMeter(engine.module, recipe.model, trainer.device),
        WeightAverager.build(t.averaging, engine, trainer.tokens_per_step, strategy),
        SpikeRollback(trainer, SpikeGuard(t.spike_guard)) if t.spike_guard.enabled else Component(),
        FatalStepCheck(engine, t, strategy.precision, trainer.files.checkpoints),
        TaskScores(engine, trainer.evaluator, tasks) if tasks else Component(),
        MixtureShares(recipe, trainer.train_data, trainer.is_rank0),
        HangEvent(trainer),
        PreferenceMetrics(trainer.steps, reference_pass(trainer)) if recipe.preference else Component(),
    ]
