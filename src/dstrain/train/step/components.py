"""What the training loop calls besides the engine: one small protocol, ``Component``, whose every hook does nothing.

A feature of the trainer (the weight averager, the spike guard and its rollback, the fatal-step check, the MoE meter,
the hang watchdog, the downstream tasks, the mixture's shares, early stopping, the Hugging Face export) is a component
that overrides the hooks it needs, built by its module's ``build(run) -> Component | None`` (None: the feature is off).
``dstrain.train.features.builders.assemble`` builds a run's list; ``Components`` calls its members in that order.

Adding a feature: a ``Component`` subclass and its ``build`` in a module of its own, and one line in
``features.BUILDERS``. What a component may touch of the trainer is ``dstrain.train.step.handle.RunHandle``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    consumed_samples: int = 0  # samples of the train stream consumed, = step x global batch
    last_eval: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step as every rank agreed on it in the step's all-reduce."""

    step: int  # the step just taken (1-based)
    loss: float  # its mean loss over all ranks
    grad_norm: float  # the pre-clip gradient norm, the mean of the ranks' readings
    stop_requested: bool  # a rank received a stop signal


class Verdict(enum.Enum):
    """What a component says of a step (``on_step_end``) or an evaluation (``on_eval_end``)."""

    GO_ON = "go on"
    UNDONE = "undone"  # it undid the step (a rollback): the loop starts its data stream and logging interval afresh
    STOP = "stop"  # stop cleanly: no more steps; the run ends as after its last (a checkpoint, the summary)


@dataclass
class StepSums:
    """What every rank adds into a step's one all-reduce, by name; packed into one tensor for it."""

    loss: torch.Tensor | float  # this rank's mean loss of the step
    grad_norm: float  # this rank's reading of the pre-clip gradient norm (0 where the engine has none)
    stop_requested: float  # 1 where this rank received a stop signal
    save_done: float  # 1 where this rank's background checkpoint write is done (or none is in flight)

    def all_reduce(self, device) -> StepSums:
        """The sums over all ranks (a collective)."""
        packed = torch.zeros(len(fields(self)), device=device)
        for i, f in enumerate(fields(self)):
            packed[i] = getattr(self, f.name)
        torch.distributed.all_reduce(packed)
        return StepSums(*packed.tolist())


class Component:
    """The protocol, every hook a no-op; a plain ``Component()`` is a feature that is off. Every rank calls every
    hook in the same order, so a hook may run a collective."""

    state_key: str | None = None  # its key in the checkpoint's ClientState.components, when it has state

    def on_train_start(self) -> None:
        """Once, before the first step (after a resume)."""

    def on_phase(self, phase: str, step: int) -> None:
        """The trainer begins ``phase`` ("step", "eval", "checkpoint", "rollback", "end"; "reference": a micro-batch
        of a preference recipe's reference pass) at optimizer step ``step``."""

    def on_mark(self, where: str) -> None:
        """A point inside a step: forward, backward, optimizer step, the step's all-reduce."""

    def lr_scale(self, step: int) -> float:
        """A factor on the schedule's learning rate for optimizer step ``step`` (1-based)."""
        return 1.0

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's backward pass differentiates, given its LM loss (the loss logged stays the LM's)."""
        return loss

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        """After the step's all-reduce. UNDONE when the component undid the step (a rollback), STOP to end the run
        cleanly after it; either way the loop calls no later component for this step."""
        return Verdict.GO_ON

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        """Fields of the train record of a logging interval of ``steps`` steps (a collective on every rank)."""
        return {}

    def valid_record_fields(self) -> dict:
        """Fields the evaluation adds to the ``valid`` record (counted in its duration)."""
        return {}

    def eval_records(self, evaluate) -> list[dict]:
        """Records of their own after an evaluation; ``evaluate``: Trainer.evaluate, to run again."""
        return []

    def on_eval_end(self, records: list[dict]) -> Verdict:
        """Every record of an evaluation, as logged (the ``valid`` record among them); STOP ends the run cleanly."""
        return Verdict.GO_ON

    def on_checkpoint_published(self, tag: str) -> None:
        """Checkpoint ``tag`` is published in the run's checkpoints/ (complete, verified on read): on every rank,
        after rank 0 published it."""

    def state_dict(self) -> dict | None:
        """What the checkpoint's client state carries for it (under ``state_key``)."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint's client state: ``state_dict()`` as it was saved, None when the run saved none."""

    def rank_files(self) -> dict:
        """{file name: state} this rank adds to a checkpoint's tag folder."""
        return {}

    def load_files(self, tag_dir: Path) -> None:
        """Read back what ``rank_files`` wrote into ``tag_dir``."""

    def close(self) -> None:
        """At the end of the run, finished or interrupted."""


class Components(Component):
    """A run's components, called in the order they were assembled: itself one (a composite)."""

    def __init__(self, members: list[Component]) -> None:
        self.members = members

    def on_train_start(self) -> None:
        for c in self.members:
            c.on_train_start()

    def on_phase(self, phase: str, step: int) -> None:
        for c in self.members:
            c.on_phase(phase, step)

    def on_mark(self, where: str) -> None:
        for c in self.members:
            c.on_mark(where)

    def lr_scale(self, step: int) -> float:
        scale = 1.0
        for c in self.members:
            scale *= c.lr_scale(step)
        return scale

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        for c in self.members:
            loss = c.objective(loss)
        return loss

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        for c in self.members:  # stops at the first that undid the step or stops the run
            verdict = c.on_step_end(outcome)
            if verdict is not Verdict.GO_ON:
                return verdict
        return Verdict.GO_ON

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return {k: v for c in self.members for k, v in c.train_record_fields(progress, steps).items()}

    def valid_record_fields(self) -> dict:
        return {k: v for c in self.members for k, v in c.valid_record_fields().items()}

    def eval_records(self, evaluate) -> list[dict]:
        return [record for c in self.members for record in c.eval_records(evaluate)]

    def on_eval_end(self, records: list[dict]) -> Verdict:
        verdicts = [c.on_eval_end(records) for c in self.members]  # every one sees every evaluation
        return Verdict.STOP if Verdict.STOP in verdicts else Verdict.GO_ON

    def on_checkpoint_published(self, tag: str) -> None:
        for c in self.members:
            c.on_checkpoint_published(tag)

    def state_dict(self) -> dict[str, dict]:
        states = {c.state_key: c.state_dict() for c in self.members if c.state_key is not None}
        return {key: state for key, state in states.items() if state is not None}

    def load_state_dict(self, state: dict | None) -> None:
        """``state``: ``state_dict()`` as saved; a component it has no key of was off in the run that saved it."""
        assert state is not None
        for c in self.members:
            if c.state_key is not None:
                c.load_state_dict(state.get(c.state_key))

    def rank_files(self) -> dict:
        return {name: state for c in self.members for name, state in c.rank_files().items()}

    def load_files(self, tag_dir: Path) -> None:
        for c in self.members:
            c.load_files(tag_dir)

    def close(self) -> None:
        for c in self.members:
            c.close()
