"""The TensorBoard monitor: scalars at the optimizer step, events as text (``events/<kind>``), the run's config
as text once, in ``output_path/job_name``.

A resumed run and a rollback open a new event file with ``purge_step`` = the first step logged again: TensorBoard's
readers (EventAccumulator, the dashboard) then drop what older files hold from that step on, so no step shows two
values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dstrain.monitors.records import describe, scalars


class TensorBoardMonitor:
    def __init__(self, folder: Path, logged_through: int, config: dict):
        self.folder = folder
        fresh = not any(folder.glob("events.out.tfevents.*"))
        self.writer = self._open(None if fresh else logged_through + 1)
        if fresh:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
            self.writer.flush()

    def _open(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.folder), purge_step=purge_step)

    def write(self, record: Mapping[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def event(self, record: Mapping[str, Any]) -> None:
        self.writer.add_text(f"events/{record['event']}", describe(record), record["step"])
        self.writer.flush()

    def drop_after(self, step: int) -> None:
        self.writer.close()
        self.writer = self._open(step + 1)

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()
