"""The gradient checks of `dstrain doctor`: named rows built from what each rank's probe recorded at every optimizer
step (dstrain.train.doctor.probe, ``run_dir/probe_rank<r>.jsonl``), each failing with the strategy and first step.

- ranks agree: every rank holding the same parameters (same pipeline stage and tensor-parallel rank) holds the same
  full gradient at the step (a hash of its bytes) and the same parameters after it. DeepSpeed#7985's rank drift.
- reported norm: the norm DeepSpeed reports (``get_global_grad_norm``, what the trainer logs and clips by) equals the
  norm of the full gradient computed by the probe. DeepSpeed#7718's 1.63 for a true 4.74.
- accumulation: backward passes per optimizer step equal the configured accumulation, one optimizer step per
  trainer step, and no skipped step under fp32 or bf16 (fp16's are counted). open-instruct#1498 and #1136.
- tied parameter: the embedding that the head shares (used twice in one backward) gets the half-precision baseline's
  gradient norm (ZeRO-1: strategy.resolve refuses ZeRO-0 there) under ZeRO-2, within the run's per-step tolerance.
  DeepSpeed#8224.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Measured on 2 CPU ranks: fp32 1.3e-7 at most; bf16 ZeRO-1 7.6e-5 (its optimizer norms the gradient as bf16 rounded
# it, the probe the fp32 accumulation). DeepSpeed#7718 was 65% off.
NORM_RTOL = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}

RANKS, NORM, ACCUMULATION, TIED = "ranks agree", "reported norm", "accumulation", "tied parameter"
WHAT = {
    RANKS: "every rank with the same parameters holds the same full gradient at each step and parameters after it",
    NORM: "DeepSpeed's reported pre-clip norm against one computed from the full gradient (relative)",
    ACCUMULATION: "backward passes per optimizer step = the configured accumulation; skipped steps 0 (fp32, bf16)",
    TIED: "the tied embedding/head gradient norm under ZeRO-2 half precision against the baseline's (relative)",
}


@dataclass
class CheckRow:
    """One named check over every run it applies to."""

    name: str
    what: str
    checked: list[str] = field(default_factory=list)  # the runs it applied to
    failures: list[str] = field(default_factory=list)  # "run: step N: ..."
    failing_runs: list[str] = field(default_factory=list)
    worst: float | None = None
    tolerance: float | None = None
    note: str = ""

    @property
    def status(self) -> str:
        return "FAILED" if self.failures else ("ok" if self.checked else "n/a")

    def fail(self, run: str, step: int, detail: str) -> None:
        self.failures.append(f"{run}: step {step}: {detail}")
        self.failing_runs.append(run)

    def worse(self, value: float) -> None:
        self.worst = value if self.worst is None else max(self.worst, value)


def probe_records(folder: Path) -> dict[int, list[dict]]:
    """{step: every rank's record of it} (a resumed run's later record of a step wins)."""
    by_key: dict[tuple[int, int], dict] = {}
    for path in sorted(folder.glob("probe_rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_key[(record["step"], record["rank"])] = record
    steps: dict[int, list[dict]] = defaultdict(list)
    for (step, _), record in sorted(by_key.items()):
        steps[step].append(record)
    return dict(steps)


def ranks_agree(row: CheckRow, name: str, steps: dict[int, list[dict]]) -> None:
    compared = False
    for step, records in steps.items():
        shards: dict[str, list[dict]] = defaultdict(list)
        for record in records:
            shards[record["shard"]].append(record)
        for shard, group in shards.items():
            if len(group) < 2:
                continue
            compared = True
            for key, what in (("grad_digest", "gradient"), ("param_digest", "parameters")):
                digests = {r["rank"]: r[key] for r in group if r[key] is not None}
                if len(set(digests.values())) > 1:
                    row.fail(name, step, f"ranks {sorted(digests)} of {shard} hold different {what}")
                    return
    if compared:
        row.checked.append(name)


def reported_norm(row: CheckRow, name: str, steps: dict[int, list[dict]], precision: str) -> None:
    tolerance = NORM_RTOL.get(precision, NORM_RTOL["bf16"])
    row.tolerance = max(row.tolerance or 0.0, tolerance)
    for step, records in steps.items():
        for record in records:
            got, want = record["reported_norm"], record["independent_norm"]
            if want is None or record["skipped"]:
                row.note = row.note or record["note"]
                return
            difference = abs(got - want) / max(want, 1e-30) if got is not None else float("inf")
            row.worse(difference)
            if not difference <= tolerance:
                row.fail(name, step, f"rank {record['rank']} reports {got} for a gradient of norm {want:.6g}")
                return
    if steps:
        row.checked.append(name)


def accumulation(row: CheckRow, name: str, steps: dict[int, list[dict]], precision: str) -> None:
    for step, records in steps.items():
        for r in records:
            if r["backwards"] != r["accumulation"] or r["optimizer_steps"] != 1:
                detail = f"rank {r['rank']}: {r['backwards']} backward passes, {r['optimizer_steps']} optimizer steps"
                row.fail(name, step, f"{detail} (accumulation {r['accumulation']})")
                return
            if r["skipped"] and precision != "fp16":
                row.fail(name, step, f"rank {r['rank']}: a skipped step under {precision}")
                return
    if steps:
        row.checked.append(name)


def tied(row: CheckRow, name: str, steps: dict, reference: dict, tolerances: list[float]) -> None:
    for step in sorted(steps):
        got = next((r["tied_grad_norm"] for r in steps[step] if r["rank"] == 0), None)
        want = next((r["tied_grad_norm"] for r in reference.get(step, []) if r["rank"] == 0), None)
        if got is None or want is None:
            row.fail(name, step, "no tied gradient recorded (the head is not tied, or the probe found no gradient)")
            return
        difference = abs(got - want) / max(want, 1e-30)
        row.worse(difference)
        tolerance = tolerances[step - 1] if step <= len(tolerances) else tolerances[-1]
        if not difference <= tolerance:
            detail = f"embedding gradient norm {got:.6g} against the baseline's {want:.6g} (tol {tolerance:.1e})"
            row.fail(name, step, detail)
            return
    row.checked.append(name)


def gradient_checks(out: Path, runs: list[dict], precisions: dict[str, str], tolerances: dict) -> list[CheckRow]:
    """The four rows over every run that logged probe records; ``tolerances``: each run's per-step tolerances."""
    rows = {name: CheckRow(name, WHAT[name]) for name in (RANKS, NORM, ACCUMULATION, TIED)}
    for run in runs:
        steps = probe_records(out / "runs" / run["name"])
        if not steps:
            continue
        ranks_agree(rows[RANKS], run["name"], steps)
        precision = precisions.get(run["name"], "fp32")
        reported_norm(rows[NORM], run["name"], steps, precision)
        accumulation(rows[ACCUMULATION], run["name"], steps, precision)
        if run.get("role") == "tied":
            reference = probe_records(out / "runs" / run["baseline"])
            tied(rows[TIED], run["name"], steps, reference, tolerances.get(run["name"]) or [0.0])
    return list(rows.values())
