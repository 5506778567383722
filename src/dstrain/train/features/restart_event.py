"""The relaunch slurm/train.sbatch made after a failed step (dstrain.train.process.elastic), as an event of this
launch's
metrics.jsonl (and so of its dashboards: a W&B alert, TensorBoard text, events.csv), logged once at its first step
under the step it resumed from, with what the failure cost: the seconds from the last step logged before it to this
first step after it, and the steps trained again (those after the checkpoint resumed)."""

from __future__ import annotations

import json
import os
import time

from dstrain.train.process.elastic import EVENTS, PENDING, folder
from dstrain.train.step.components import Component, StepOutcome, Verdict
from dstrain.train.step.handle import RunHandle


def build(run: RunHandle) -> RestartEvent:
    return RestartEvent(run)


class RestartEvent(Component):
    def __init__(self, run: RunHandle) -> None:
        self.run, self.pending = run, folder(run.files.root) / PENDING
        self.logged = False

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        if self.logged or not self.run.is_rank0:
            return Verdict.GO_ON
        self.logged = True
        if not self.pending.is_file():
            return Verdict.GO_ON
        event = json.loads(self.pending.read_text())
        resumed = outcome.step - 1
        # At the step it resumed from, as the resume event: a later relaunch from that checkpoint keeps it
        event.update(
            step=resumed,
            first_step=outcome.step,
            steps_lost=max(0, event.get("fault_step", resumed) - resumed),
            time_lost_s=round(time.time() - event.pop("fault_time", time.time()), 3),
        )
        self.run.log.write(event)
        with open(self.pending.with_name(EVENTS), "a") as f:
            f.write(json.dumps(event) + "\n")
        os.remove(self.pending)
        print(
            f"dstrain: {event['event']} at step {outcome.step}: {event['time_lost_s']:.1f} s and "
            f"{event['steps_lost']} step(s) lost ({event.get('detail', '')})",
            flush=True,
        )
        return Verdict.GO_ON
