"""The dashboards of a run: W&B, TensorBoard and CSV files, each a sink of what metrics.jsonl receives.

Every record ``MetricsLog`` writes reaches each enabled monitor at its optimizer step: a train record as
``train/<key>``, an eval record of split ``valid`` as ``eval/<key>`` and of split ``valid/<source>`` (a data source,
``averaged`` for the averaged weights) as ``eval/<source>/<key>``; events (a resume, a rolled-back spike) as the
monitor shows text. Rank 0 alone writes them. What each monitor makes of a resume or a rollback, so that no step
shows two values, is in its module; docs/monitoring.md says it for users.

The protocol, one small interface each monitor keeps: ``write(record)``, ``event(record)``, ``drop_after(step)``
(a rollback: the records after ``step`` belong to a discarded stretch) and ``close(exit_code)``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from dstrain.monitors.settings import monitor_settings
from dstrain.run_dir import LAUNCH_KEY, RunDir


class Monitor(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def event(self, record: Mapping[str, Any]) -> None: ...

    def drop_after(self, step: int) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


class Monitors:
    """The enabled monitors as one. A monitor that fails is reported in one line and closed; training goes on
    (a dashboard is not worth a run, and metrics.jsonl holds everything)."""

    def __init__(self, monitors: list[Monitor]):
        self.monitors = monitors

    def _each(self, method: str, *args) -> None:
        for monitor in list(self.monitors):
            try:
                getattr(monitor, method)(*args)
            except Exception as e:
                print(
                    f"dstrain: warning: the {type(monitor).__name__} stopped ({type(e).__name__}: {e}); "
                    f"metrics.jsonl goes on",
                    file=sys.stderr,
                    flush=True,
                )
                self.monitors.remove(monitor)

    def write(self, record: Mapping[str, Any]) -> None:
        self._each("event" if "event" in record else "write", record)

    def drop_after(self, step: int) -> None:
        self._each("drop_after", step)

    def close(self, exit_code: int = 0) -> None:
        """``exit_code``: the training command's (W&B marks a run that ends with another than 0 failed)."""
        self._each("close", exit_code)
        self.monitors = []


def run_config(files: RunDir) -> dict:
    """What W&B and TensorBoard record once as the run's config: the recipe and the resolved ds_config, as the run
    folder holds them (the launch record apart)."""
    recipe = yaml.safe_load(files.recipe.read_text()) if files.recipe.is_file() else {}
    launch = recipe.pop(LAUNCH_KEY, None)
    ds_config = json.loads(files.ds_config.read_text()) if files.ds_config.is_file() else {}
    return {"recipe": recipe, "ds_config": ds_config, "launch": launch}


def open_monitors(files: RunDir, kept: list[dict], env: Mapping[str, str] = os.environ) -> Monitors:
    """Rank 0: the monitors the run folder's ds_config.json enables, continuing what they hold of this run.
    ``kept``: the records of metrics.jsonl a resumed run keeps (those up to its checkpoint); it logs the later steps
    again."""
    if not files.ds_config.is_file():
        return Monitors([])
    settings = monitor_settings(json.loads(files.ds_config.read_text()), files.root, env)
    if not settings.any:
        return Monitors([])
    config = run_config(files)
    logged_through = max((r["step"] for r in kept), default=0)
    monitors: list[Monitor] = []
    if settings.csv is not None:
        from dstrain.monitors.csv_files import CsvMonitor

        monitors.append(CsvMonitor(settings.csv, logged_through))
    if settings.tensorboard is not None:
        from dstrain.monitors.tensorboard_events import TensorBoardMonitor

        monitors.append(TensorBoardMonitor(settings.tensorboard, logged_through, config))
    if settings.wandb is not None:
        from dstrain.monitors.wandb_run import WandbMonitor

        name = str(config["recipe"].get("name") or Path(files.root).name)
        monitors.append(WandbMonitor(settings.wandb, files.wandb_run, name, config, kept))
    return Monitors(monitors)
