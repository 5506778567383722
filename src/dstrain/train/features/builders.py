"""Where a run's components are assembled (dstrain.train.step.components): one builder per feature, in the order the
loop
calls them. Each builder is its module's ``build(run) -> Component | None``: None when the recipe leaves the feature
off, the one way a feature is off. A new feature of the trainer is a module with its Component and its ``build``, and
one line here; the loop does not change.

The order matters where components act on one step: the averager takes in the step's weights before the spike guard
may roll them back, and the fatal-step check sees only a step that was not undone."""

from __future__ import annotations

from collections.abc import Callable

from dstrain.train.features import (
    averaging,
    balancing,
    early_stop,
    fatal_steps,
    hf_export,
    mixture,
    moe_metrics,
    restart_event,
    spike_rollback,
    task_eval,
    watchdog,
)
from dstrain.train.step.components import Component
from dstrain.train.step.handle import RunHandle

BUILDERS: tuple[Callable[[RunHandle], Component | None], ...] = (
    watchdog.build,  # the hang watchdog (train.watchdog)
    moe_metrics.build,  # router losses and expert shares (MoE models)
    averaging.build,  # EMA / last-N of the weights (train.averaging)
    spike_rollback.build,  # the spike guard and its rollback (train.spike_guard)
    fatal_steps.build,  # fp16 overflow runs, a non-finite loss
    balancing.build,  # DeepSeek-V3's loss-free balancing: the routers' bias after each step that stands
    task_eval.build,  # downstream tasks at each evaluation (train.tasks)
    mixture.build,  # the data mixture's stages and shares
    watchdog.build_hang_event,  # the previous launch's hang, as an event
    early_stop.build,  # early stopping on the valid loss (train.early_stop)
    hf_export.build,  # each published checkpoint as a Hugging Face folder (train.export_every)
    restart_event.build,  # slurm/train.sbatch's relaunch after a failed step, as an event
)


def assemble(run: RunHandle, objectives: tuple[Callable[[RunHandle], Component | None], ...] = ()) -> list[Component]:
    """The components of ``run`` (dstrain.train.loop.Trainer, not yet running) whose features are on, then those of
    its objective (``objectives``: dstrain.train.objectives.training.ObjectiveTraining.components)."""
    return [component for build in (*BUILDERS, *objectives) if (component := build(run)) is not None]
