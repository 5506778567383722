"""DeepSpeed's known silent gradient bugs, the versions they affect, and the doctor row that catches each: the table
docs/troubleshooting.md prints, and the one-line warnings of a report whose installed DeepSpeed is in a known-bad
range for a feature the checked strategies use.

Ranges are what the public threads establish (PEP 440 specifiers); "" where they do not, and such an entry warns of
nothing (its doctor row still runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class KnownBug:
    """One upstream defect. ``needs``: the features a run must use for it to bite (``features_of``'s names)."""

    issue: str
    affected: str  # a PEP 440 specifier of DeepSpeed versions; "" when not established
    needs: frozenset[str]
    symptom: str
    rows: str  # the doctor rows that catch it


CATALOGUE: tuple[KnownBug, ...] = (
    KnownBug(
        "allenai/open-instruct#1498",
        "",  # DeepSpeed's ZeRO-2 behaviour at every accumulation boundary, not a regression of one release
        frozenset({"zero2", "manual accumulation"}),
        "ZeRO-2 keeps only the last micro-batch's gradient when the caller accumulates with "
        "gradient_accumulation_steps 1 (each backward a boundary resets the partition's accumulator)",
        "strategies at accumulation >= 2; accumulation",
    ),
    KnownBug(
        "allenai/open-instruct#1136",
        ">=0.17.3",  # open-instruct lowered its pin from <0.17.6 to <0.17.3; no upper bound was established
        frozenset({"manual accumulation"}),
        "gradient accumulation broke from 0.17.3 on for a trainer that accumulates itself (cause not established "
        "there; #1498 later found the ZeRO-2 boundary reset)",
        "strategies at accumulation >= 2; accumulation",
    ),
    KnownBug(
        "deepspeedai/DeepSpeed#7718",
        ">=0.17.6,<0.18.3",  # reported from 0.17.6; fixed in 0.18.3 (TRL's maintainers, huggingface/trl#4540)
        frozenset({"zero2"}),
        "ZeRO-2 computes wrong gradients; the reported norm read 1.63 against a true 4.74, losses close at first",
        "strategies (the norm from step 1); reported norm",
    ),
    KnownBug(
        "deepspeedai/DeepSpeed#7985",
        "",  # the thread was not found by this project's search; versions not established
        frozenset({"data parallel"}),
        "data-parallel ranks drift apart (3.8% on one rank's gradient, ~2% on the norm)",
        "ranks agree; strategies at half precision (twin tolerance, no longer a fixed 2e-2)",
    ),
    KnownBug(
        "deepspeedai/DeepSpeed#8224",
        ">=0.18.3,<=0.19.3",  # correct on 0.18.2, wrong 0.18.3 through 0.19.3 (the report); fixed by #8245 after
        frozenset({"zero2", "bf16", "tied"}),
        "ZeRO-2 + bf16 on several ranks: a parameter used twice in one backward misses one use's gradient",
        "tied parameter; strategies (zero2_bf16_tied)",
    ),
    KnownBug(
        "deepspeedai/DeepSpeed#7837",
        "",  # fixed by #7839 (February 2026); the first fixed release was not established
        frozenset({"zero0", "bf16"}),
        "ZeRO-0 + bf16: gradients divided by 65,536 (a loss scale never applied) and accumulated across steps",
        "none needed: strategy.resolve refuses ZeRO-0 + bf16 (the bf16 baseline is ZeRO-1)",
    ),
)


def features_of(runs: list[dict], tied_recipe: bool) -> dict[str, list[str]]:
    """{feature: the runs using it}: zero<stage>, the precision, data parallel, accumulation, tied."""
    from dstrain.strategy.resolve import precision_of

    used: dict[str, list[str]] = {}
    for run in runs:
        try:
            config = json.loads(Path(run["config"].split(" then ")[0]).read_text())
        except (OSError, ValueError):
            continue
        names = {f"zero{config.get('zero_optimization', {}).get('stage', 0)}", precision_of(config), "data parallel"}
        if run.get("accumulation", 1) >= 2:
            names.add("accumulation")
        if tied_recipe or run.get("role") == "tied":
            names.add("tied")
        for name in names:
            used.setdefault(name, []).append(run["name"])
    return used


def warnings(installed: str, used: dict[str, list[str]]) -> list[str]:
    """One line per known bug whose range holds ``installed`` and whose features the runs use together."""
    found = []
    for bug in CATALOGUE:
        if not bug.affected or Version(installed) not in SpecifierSet(bug.affected):
            continue
        runs = set.intersection(*(set(used.get(name, [])) for name in bug.needs))
        if runs:
            found.append(
                f"warning: DeepSpeed {installed} is in {bug.issue}'s known-bad range {bug.affected} for "
                f"{' + '.join(sorted(bug.needs))} ({', '.join(sorted(runs))}): {bug.symptom}"
            )
    return found


def markdown_table() -> list[str]:
    lines = ["| issue | affected DeepSpeed | when | symptom | doctor row |", "|---|---|---|---|---|"]
    for bug in CATALOGUE:
        lines.append(
            f"| {bug.issue} | {bug.affected or 'not established'} | {' + '.join(sorted(bug.needs))} | "
            f"{bug.symptom} | {bug.rows} |"
        )
    return lines
