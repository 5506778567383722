"""The CSV monitor: DeepSpeed's csv_monitor layout (one ``<name>.csv`` per number, ``/`` read as ``_``, rows of
step and value, in ``output_path/job_name``), written by dstrain at the optimizer step, plus ``events.csv``.

A resumed run and a rollback cut every file back to the steps still valid, so each step has one row.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dstrain.files import write_text_atomic
from dstrain.monitors.records import describe, scalars

EVENTS = "events.csv"  # a number's file is named train_... or eval_..., never this


class CsvMonitor:
    def __init__(self, folder: Path, logged_through: int):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.drop_after(logged_through)

    def _append(self, path: Path, header: list[str], row: list) -> None:
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(header)
            writer.writerow(row)

    def write(self, record: Mapping[str, Any]) -> None:
        for name, value in scalars(record).items():
            self._append(
                self.folder / (name.replace("/", "_").replace(" ", "_") + ".csv"),
                ["step", name.rsplit("/", 1)[-1]],
                [record["step"], value],
            )

    def event(self, record: Mapping[str, Any]) -> None:
        self._append(
            self.folder / EVENTS, ["step", "event", "text"], [record["step"], record["event"], describe(record)]
        )

    def drop_after(self, step: int) -> None:
        """Keep each file's rows up to ``step``, atomically."""
        for path in self.folder.glob("*.csv"):
            with path.open(newline="") as f:
                rows = list(csv.reader(f))
            kept = rows[:1] + [row for row in rows[1:] if row and _step(row) <= step]
            if len(kept) == len(rows):
                continue
            text = io.StringIO()
            csv.writer(text).writerows(kept)
            write_text_atomic(path, text.getvalue())

    def close(self, exit_code: int = 0) -> None:
        pass


def _step(row: list[str]) -> float:
    try:
        return int(row[0])
    except ValueError:
        return float("inf")
