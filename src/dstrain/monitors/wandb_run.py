"""The W&B monitor: one W&B run per dstrain run, however often it is requeued or resumed.

The run's id lives in the run folder (RunDir.wandb_run), with the last step W&B surely holds; a resumed run
continues it (``resume="allow"``), and ``--resume none`` moves the file aside with the rest of the old run, so a new
W&B run starts. Every number goes at the optimizer step, W&B's own step (``_step``): one x-axis.

W&B keeps what it was sent and refuses a step below its last, so the steps a resume or a rollback trains again
(after the checkpoint, up to where the last attempt got) are not sent a second time: W&B shows their first values,
the events say what happened, metrics.jsonl and TensorBoard hold the values trained again. What W&B surely holds:
what a job sent before it closed its run, or, online, what the server's history holds; a job killed hard takes its
unwritten records with it (W&B's service dies with it), and the next job sends those steps again.

Events are W&B alerts (the run's page and the team's notifications) and the ``events`` table of the run's summary.
The config, the recipe and the resolved ds_config, is set when the run is created (updated on a resume, where the
current recipe applies).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dstrain.files import write_json_atomic
from dstrain.monitors.records import describe, scalars
from dstrain.monitors.settings import WandbSettings

EVENT_COLUMNS: list[str | int] = ["step", "event", "text"]


class WandbMonitor:
    def __init__(self, settings: WandbSettings, id_file: Path, name: str, config: dict, kept: list[dict]):
        """``kept``: metrics.jsonl's records so far; those W&B may not hold (a killed job's last ones) are sent."""
        import wandb

        self.wandb, self.id_file = wandb, id_file
        saved = json.loads(id_file.read_text()) if id_file.is_file() else None
        # Steps up to here are in W&B already (an earlier job closed its run with them): not sent again.
        self.sent_through = int(saved["logged_through"]) if saved else -1
        settings.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            name=name,
            id=saved["id"] if saved else None,  # W&B names a new run
            resume="allow",
            dir=str(settings.dir),
            mode=settings.mode,
            config=None if saved else config,
            # dstrain keeps the console in logs/rank<r>.log (train/process/console.py), W&B capturing it too would wrap
            # it
            # twice; quiet: dstrain prints the one line that says where the run is, W&B no summary of every number
            settings=wandb.Settings(console="off", quiet=True),
        )
        if saved:
            self.run.config.update(config, allow_val_change=True)
        if saved and settings.mode == "online":  # the server's history says how far a killed job's rows got
            self.sent_through = max(self.sent_through, self.run.step - 1)
        self.floor = self.sent_through
        self._save()  # before the first number: a job killed now still continues this W&B run
        self.events = [[r["step"], r["event"], describe(r)] for r in kept if "event" in r]
        for record in kept:
            if "event" not in record:
                self.write(record)
        folder = Path(self.run.dir).parent  # this job's offline-run-* / run-* folder
        # run.url warns in offline mode, where there is none
        where = self.run.url if settings.mode == "online" else f"wandb sync {folder} uploads it"
        state = "continues" if saved else "started"
        print(f"W&B run {self.run.id} {state} ({settings.mode}, project {settings.project}): {where}", flush=True)

    def _save(self) -> None:
        write_json_atomic(self.id_file, {"id": self.run.id, "logged_through": self.sent_through})

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if step <= self.floor:
            return
        self.run.log(scalars(record), step=step)
        self.sent_through = max(self.sent_through, step)

    def event(self, record: Mapping[str, Any]) -> None:
        text = describe(record)
        self.events.append([record["step"], record["event"], text])
        level = "INFO" if record["event"] == "resume" else "WARN"
        self.run.alert(title=f"{self.run.name}: {record['event']} at step {record['step']}", text=text, level=level)
        self.run.summary["events"] = self.wandb.Table(columns=EVENT_COLUMNS, data=self.events)

    def drop_after(self, step: int) -> None:
        self.floor = max(self.floor, self.sent_through)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
        # Only now is what was sent durable: a killed job's W&B service dies with it, before writing its last
        # records (offline: before its first 32 KiB block), so its steps are sent again by the next job.
        self._save()
