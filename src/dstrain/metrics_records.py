"""metrics.jsonl's schema and its reader: the train, eval and event records a run writes (one JSON object a line), and
what the commands read back from them. No torch: ``dstrain compare`` and the plots read runs without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, TypedDict, cast

from dstrain.files import write_text_atomic


class MetricsRecord(TypedDict, total=False):
    """One train or eval line of metrics.jsonl. A train record has no ``split``; an eval record's split is
    ``valid`` (the sources' weighted total) or ``valid/<source>``. MoE runs add ``moe_aux_loss``, ``moe_z_loss`` and
    ``moe_layer<i>_share_{min,max,entropy}`` (keys a TypedDict cannot name)."""

    step: Required[int]
    loss: Required[float]
    split: str  # eval records only
    ppl: float  # eval
    samples: int  # eval: the samples evaluated
    duration_s: float  # eval: the total ("valid") record only
    consumed_samples: int
    consumed_tokens: int
    lr: float
    grad_norm: float | None  # pre-clip, fp32; None where the engine does not compute it
    loss_scale: float | None  # fp16 only
    skipped_steps: int
    learned_tokens: float  # per step (mean over the logged interval): the global batch's tokens with a label, the
    # loss's divisor (all of them for text; a --chat sample's assistant tokens)
    tokens_per_s: float  # over all ranks, training time only: every token processed, learned or not
    tflops_per_device: float
    mfu: float | None  # None where the device's peak is unknown
    mem_peak_bytes: int  # the largest of all ranks
    elapsed_s: float
    train_s: float  # the logging interval's seconds (IntervalClock.lap)
    eval_s: float
    checkpoint_s: float
    moe_aux_loss: float
    moe_z_loss: float


class EventRecord(TypedDict, total=False):
    """One event line of metrics.jsonl: a resume (``tag``, ``changed``), a loss spike rolled back, a run stopped
    by an error (``message``), the previous launch's hang (logged by the launch after it), or a relaunch of
    slurm/train.sbatch after a failed step (restart, spare, shrink, requeue: dstrain.train.process.elastic)."""

    step: Required[int]
    # "resume" | "spike" | "disk_full" | "stopped" | "hang" | "early_stop" | "hf_export"
    # | "restart" | "spare" | "shrink" | "requeue"
    event: Required[str]
    message: str  # disk_full, stopped: the error's line
    hang_step: int  # hang: the step the watchdog found stalled
    at: str  # hang: where in it (e.g. "backward 0 of step 5")
    detail: str  # hang: the watchdog's line, naming the stalled ranks
    tag: str  # resume: the checkpoint tag resumed from
    changed: dict  # resume: recipe key -> [old, new]
    spike_step: int  # spike
    metric: str  # spike: what the guard watched
    value: float  # spike: the value that tripped it
    median: float  # spike: the median of the guard's window
    threshold: float  # spike: factor x median
    rolled_back_to: str | None  # spike: the tag reloaded; None before the first checkpoint
    skipped_samples: list[int] | None  # spike: [first, end) of the samples skipped on the way back
    best_loss: float  # early_stop: the best valid loss of the run
    loss: float  # early_stop: the valid loss of the evaluation that stopped it
    folder: str  # hf_export: the Hugging Face folder written (tag: the checkpoint's)


@dataclass(frozen=True)
class SourceLoss:
    """One data source's evaluation: the token-weighted mean loss of its first ``samples`` samples."""

    name: str
    weight: float  # its data.sources weight
    loss: float
    samples: int


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged run's loss would overflow it


def evaluation_summary(sources: list[SourceLoss]) -> dict:
    """The evaluation of all sources, as the trainer's ``valid`` record and ``dstrain eval`` both give it: the
    sources' losses averaged by their data.sources weights, and the samples evaluated."""
    loss = sum(s.weight * s.loss for s in sources) / sum(s.weight for s in sources)
    return {"loss": loss, "ppl": perplexity(loss), "samples": sum(s.samples for s in sources)}


def _parse(line: str) -> dict | None:
    """A metrics.jsonl line, or None for one cut short by a killed job."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


def read_all(metrics: Path) -> list[dict]:
    """Every record of ``metrics``, events included; lines cut short by a killed job are skipped."""
    if not metrics.is_file():
        return []
    return [record for line in metrics.read_text().splitlines() if (record := _parse(line)) is not None]


def read_records(metrics: Path) -> list[MetricsRecord]:
    """The train and eval records of ``metrics`` (a missing file has none); event records and lines cut short
    by a killed job are skipped."""
    return cast("list[MetricsRecord]", [r for r in read_all(metrics) if "event" not in r])


def read_events(metrics: Path) -> list[EventRecord]:
    """The event records of ``metrics`` (a resume, a rolled-back spike)."""
    return cast("list[EventRecord]", [r for r in read_all(metrics) if "event" in r])


def drop_records_after(metrics: Path, step: int) -> None:
    """Keep only the records up to ``step`` (a resume or a rollback logs the later steps again), atomically."""
    if not metrics.exists():
        return
    kept = [line for line in metrics.read_text().splitlines() if _logged_step(line) <= step]
    write_text_atomic(metrics, "".join(line + "\n" for line in kept))


def _logged_step(line: str) -> float:
    """The step of a metrics line; a line cut short by a killed job counts as after any checkpoint."""
    record = _parse(line)
    return float("inf") if record is None else record["step"]


def realised_mix(record: Mapping[str, Any]) -> dict[str, float]:
    """Each source's share of a logged interval's samples (``mix_<source>``, logged when the data blends sources)."""
    return {key.removeprefix("mix_"): float(value) for key, value in record.items() if key.startswith("mix_")}


def task_names(record: Mapping[str, Any]) -> list[str]:
    """The downstream tasks an eval record holds (``task/<name>/acc``), in logged order."""
    return [key.split("/")[1] for key in record if key.startswith("task/") and key.endswith("/acc")]
