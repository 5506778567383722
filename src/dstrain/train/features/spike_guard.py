"""Loss-spike rollback: the run notices a spike, reloads the newest complete checkpoint, skips the data that
produced the spike and goes on, as the OPT and BLOOM logbooks did by hand. Here the guard's statistic and state;
the rollback itself is dstrain.train.features.spike_rollback.SpikeRollback.roll_back.

The statistic is the median of the last ``window`` steps' values (loss or pre-clip gradient norm), and a spike is
a value above ``factor`` x that median (or not finite). A median rather than a mean or a z-score: an earlier spike,
a slow drift or a noisy batch does not move it, and it needs no variance estimate from a short history. The value
comes from the step's one all-reduce, so every rank sees the same number and takes the same decision.

Data: global batch k reads samples [k*G, (k+1)*G) of ``consumed_samples`` (dstrain.train.loop). A rollback to a
checkpoint at consumed_samples C after a spike at consumed_samples S (counted through the spiking step) restores
the weights, optimizer and RNG of C but continues reading at S: samples [C, S) are never trained on. The windows
skipped, the spikes seen and the running statistic live in every checkpoint's client state, and the checkpoint
rolled back to is saved again at once with them, so a job killed after a rollback resumes without reading the
window again and equals the uninterrupted run bit for bit.
"""

from __future__ import annotations

import statistics

from dstrain.config import SpikeGuardConfig


class SpikeGuard:
    """The guard's state: the running window, the spikes seen (by step) and the sample windows skipped."""

    def __init__(self, config: SpikeGuardConfig):
        self.config = config
        self.history: list[float] = []
        self.spikes: list[int] = []
        self.skipped: list[list[int]] = []  # [first sample, end sample) per rollback
        self.lr_until = 0  # steps <= lr_until run with lr x lr_factor

    def threshold(self) -> float | None:
        """The value above which a step is a spike; None while the window is not full."""
        if len(self.history) < self.config.window:
            return None
        return self.config.factor * statistics.median(self.history)

    def observe(self, value: float) -> float | None:
        """The threshold ``value`` broke (a spike, not added to the window), or None (added)."""
        limit = self.threshold()
        if limit is not None and not value <= limit:  # also catches nan
            return limit
        self.history = [*self.history, value][-self.config.window :]
        return None

    def too_many(self, step: int) -> bool:
        """Record a spike at ``step``; True when the spikes within rollback_window exceed max_rollbacks."""
        self.spikes.append(step)
        recent = [s for s in self.spikes if step - s < self.config.rollback_window]
        return len(recent) > self.config.max_rollbacks

    def lr_scale(self, step: int) -> float:
        """The factor on the schedule's lr for optimizer step ``step`` (1-based)."""
        return self.config.lr_factor if step <= self.lr_until else 1.0

    def state_dict(self) -> dict:
        return {
            "history": list(self.history),
            "spikes": list(self.spikes),
            "skipped": self.skipped,
            "lr": self.lr_until,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """``state_dict()`` as saved; None (a checkpoint of a run without the guard): the guard starts afresh."""
        if state is None:
            state = SpikeGuard(self.config).state_dict()
        self.history = list(state["history"])
        self.spikes = list(state["spikes"])
        self.skipped = [list(w) for w in state["skipped"]]
        self.lr_until = int(state["lr"])
