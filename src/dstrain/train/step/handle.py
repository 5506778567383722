"""What a component may touch of the trainer: ``RunHandle``, the one typed view its ``build`` and hooks get
(dstrain.train.loop.Trainer is one, structurally; a test may pass any object that has these members)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from dstrain.checkpoint.model_source import ModelSource
    from dstrain.checkpoint.record import ClientState
    from dstrain.config import Recipe
    from dstrain.metrics import MetricsLog
    from dstrain.run_dir import RunDir
    from dstrain.strategy.resolve import Strategy
    from dstrain.train.step.components import Components, Progress
    from dstrain.train.step.evaluator import Evaluator
    from dstrain.train.step.forward import ModelForward


class RunHandle(Protocol):
    recipe: Recipe
    strategy: Strategy
    engine: Any  # DeepSpeed's engine (its module, optimizer, skipped_steps)
    files: RunDir  # the run folder
    rank: int
    world: int
    dp_rank: int  # this rank's data-parallel replica (its TP, PP and SP partners share it)
    is_rank0: bool
    device: torch.device
    progress: Progress  # the step and samples consumed
    tokens_per_step: int
    train_data: Any  # the train stream's dataset (dstrain.data.dataset)
    log: MetricsLog  # metrics.jsonl and the dashboards
    evaluator: Evaluator  # valid losses and task scores, through the engine of any strategy
    forward: ModelForward  # the model's forward that training and evaluation share (its loss, its sums)
    components: Components  # every component, for a hook one of them starts (a rollback's on_phase)
    model_source: ModelSource | None  # init_from, resolved once at launch (None without one)

    def restore(self, tag: str) -> ClientState:
        """Load checkpoint ``tag`` into the engine, the data position and every component."""
        ...

    def save(self, background: bool = False) -> str | None:
        """A checkpoint of this step; its tag once published (None: written in the background, published later)."""
        ...

    def finish_pending_save(self) -> None:
        """Wait for the background write in flight, if any, and publish it."""
        ...
