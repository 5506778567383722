"""A compared run's folder read back into its row of `dstrain compare`'s report: losses, throughput, memory,
the realised mix, task accuracies, and why a run that did not complete stopped."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dstrain.commands.report import GIB, Row
from dstrain.metrics_records import read_records, realised_mix, task_names
from dstrain.run_dir import RunDir

LOG_NAME = "launcher.log"
OOM = re.compile(r"OutOfMemoryError|out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
ERROR_LINE = re.compile(r"\b[\w.]*(?:Error|Exception)\b:?.*")  # "torch.OutOfMemoryError: CUDA out of memory. ..."


def find_log(run_dir: Path) -> Path | None:
    """launcher.log, else the newest *.log / *.out (a Slurm job's output) in the run folder."""
    if (run_dir / LOG_NAME).is_file():
        return run_dir / LOG_NAME
    logs = [p for p in [*run_dir.glob("*.log"), *run_dir.glob("*.out")] if p.is_file()]  # not a dangling link
    logs.sort(key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def failure(log: str) -> tuple[str, str]:
    """(status, reason) of a run that left no summary: the trainer's one-liner, else the last error line.

    A log without any error line belongs to a run still going, or one killed without a word (Slurm's time limit).
    """
    lines = [line.strip() for line in log.splitlines() if line.strip() and not line.startswith("$ ")]
    mine = [line for line in lines if "dstrain: error:" in line]
    if mine:
        return "invalid config", mine[-1].split("dstrain: error:", 1)[1].strip()
    errors = [m.group(0) for line in lines if (m := ERROR_LINE.search(line))]
    if errors:
        return ("out of memory" if OOM.search(log) else "crashed"), errors[-1]
    return "incomplete", lines[-1] if lines else "empty log"


def strategy_columns(ds: dict) -> dict:
    """The strategy columns of a ds_config (resolved or as written)."""
    from dstrain.strategy.resolve import offload_of, precision_of

    zero = ds.get("zero_optimization", {})
    offload = [
        f"{k.split('_')[1]}:{offload_of(ds, k)}" for k in ("offload_optimizer", "offload_param") if offload_of(ds, k)
    ]
    ints = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    pp = int(ds.get("pipeline", {}).get("stages", 1))
    tp = int(ds.get("tensor_parallel", {}).get("autotp_size", 1))
    sp = int(ds.get("sequence_parallel_size", 1))
    expert = ds.get("expert_parallel", {})
    world = None
    batch, micro, accumulation = ints
    if isinstance(batch, int) and isinstance(micro, int) and isinstance(accumulation, int) and micro * accumulation > 0:
        # pipeline engines and sequence parallelism count the data-parallel world
        world = batch // (micro * accumulation) * pp * sp
    return dict(
        zero_stage=zero.get("stage", 0),
        pp_stages=pp,
        tp_size=tp,
        sp_size=sp,
        ep_size=int(expert.get("autoep_size", 1)) if expert.get("enabled", False) else 1,
        precision=precision_of(ds),
        offload=", ".join(offload) or "none",
        micro_batch=ints[1],
        grad_accum=ints[2] if isinstance(ints[2], int) else None,
        world_size=world,
    )


def steady(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return statistics.median(known[1:]) if len(known) > 1 else known[0]


def read_run(run_dir: Path, ds_file: str | None = None) -> Row:
    """One row from whatever the run left: metrics.jsonl, summary.json, ds_config.json, its log."""
    row = Row(config=run_dir.name, status="incomplete")
    files = RunDir(run_dir)
    ds_path = files.ds_config if files.ds_config.is_file() else ds_file
    if ds_path and Path(ds_path).is_file():
        try:
            for key, value in strategy_columns(json.loads(Path(ds_path).read_text())).items():
                setattr(row, key, value)
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            pass  # a malformed config: the run's log says why
    records = read_records(files.metrics)
    # a requeued Slurm task resumes from its checkpoint and logs those steps again: keep the latest of each
    train = sorted({r["step"]: r for r in records if "split" not in r}.values(), key=lambda r: r["step"])
    evals = [r for r in records if r.get("split") == "valid"]  # the weighted total, not a source's valid/<name>
    if train:
        row.curve = [(r["step"], r["loss"]) for r in train]
        row.mix = [(r["step"], mix) for r in train if (mix := realised_mix(r))]
        row.final_loss, row.steps = train[-1]["loss"], train[-1]["step"]
        row.tokens_per_s = steady([r.get("tokens_per_s") for r in train])
        row.tflops_per_device = steady([r.get("tflops_per_device") for r in train])
        row.mfu = steady([r.get("mfu") for r in train])
        peaks = [r["mem_peak_bytes"] for r in train if r.get("mem_peak_bytes")]
        row.mem_peak_gib = max(peaks) / GIB if peaks else None
    if evals:
        row.valid_loss = evals[-1]["loss"]
        row.tasks = task_summary(evals[-1])
    summary = files.summary
    if summary.is_file():
        row.status = json.loads(summary.read_text()).get("status", "incomplete")
    log = find_log(run_dir)
    if row.status == "interrupted":
        row.reason = f"stopped by a signal after step {row.steps}; its checkpoint is in {files.checkpoints}"
    elif not row.ok and log is not None:
        row.status, row.reason = failure(log.read_text(errors="replace"))
    elif not row.ok:
        row.status, row.reason = "missing", f"{run_dir} holds no log and no summary.json"
    return row


def task_summary(record: Mapping[str, Any]) -> str:
    """``hellaswag 0.312/0.344, lambada 0.050``: an eval record's task accuracies (acc/acc_norm)."""
    parts = []
    for name in task_names(record):
        norm = record.get(f"task/{name}/acc_norm")
        parts.append(f"{name} {record[f'task/{name}/acc']:.3f}" + ("" if norm is None else f"/{norm:.3f}"))
    return ", ".join(parts)
