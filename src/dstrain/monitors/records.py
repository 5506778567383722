"""A metrics.jsonl record as the monitors show it: its numbers under their names, an event in one line."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A train or eval record's numbers under the monitors' names (None, text and flags left out)."""
    split = record.get("split")
    prefix = "train" if split is None else "eval" + split.removeprefix("valid")
    return {
        f"{prefix}/{key}": value
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def describe(record: Mapping[str, Any]) -> str:
    """An event record in one line, as a dashboard shows it."""
    kind, step = record["event"], record["step"]
    if kind == "resume":
        changed = record.get("changed") or {}
        line = f"resumed from {record.get('tag')} at step {step}"
        if changed:
            line += "; recipe changed: " + ", ".join(f"{k} {old} → {new}" for k, (old, new) in changed.items())
        return line
    if kind == "spike":
        value, threshold = record["value"], record["threshold"]
        what = f"{record['metric']} spike at step {record['spike_step']} ({value:.4g} > {threshold:.4g})"
        skipped = record.get("skipped_samples")
        if not skipped:
            return what + "; no checkpoint yet, training went on"
        return f"{what}: rolled back to {record['rolled_back_to']}, skipping samples {skipped[0]}-{skipped[1] - 1}"
    if kind in (
        "restart",
        "spare",
        "shrink",
        "requeue",
    ):  # slurm/train.sbatch's relaunch (dstrain.train.process.elastic)
        return (
            f"{kind} at step {step}: {record.get('detail', '')}; "
            f"{record.get('time_lost_s', 0):.0f} s and {record.get('steps_lost', 0)} step(s) lost"
        )
    if "message" in record:  # a run stopped by an error: disk_full, stopped
        return f"{kind} at step {step}: {record['message']}"
    details = {k: v for k, v in record.items() if k not in ("event", "step")}
    return f"{kind} at step {step}" + (f": {json.dumps(details)}" if details else "")
