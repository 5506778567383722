"""What bench/gpu_check.py leaves in OUT after every part: gpu_check.json (every figure), gpu_check.md (the plan's
status and each part's table) and logs.tar.gz."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out: Path, work: Path, figures: dict, plan: list, failures: list[str]) -> None:
    """gpu_check.json, gpu_check.md and logs.tar.gz in OUT (three files: what a loan's OUT brings back)."""
    device = "dry run, CPU" if figures["dry_run"] else figures.get("machine", {}).get("device", "?")
    lines = [
        f"# dstrain GPU check ({device}), {figures['started']}",
        "",
        "```",
        json.dumps(figures.get("machine")),
        "```",
    ]
    lines += ["", "| part | status | seconds | estimated s | measured |", "|---|---|---|---|---|"]
    for part in plan:
        entry = figures["parts"].get(part.name, {"status": "not reached"})
        status = entry["status"] + (f": {entry['reason']}" if entry.get("reason") else "")
        lines.append(
            f"| {part.name} | {status} | {entry.get('seconds', '')} | {part.estimate_s:.0f} | "
            f"{entry.get('measured', '')} |"
        )
    for part in plan:
        rows = figures["parts"].get(part.name, {}).get("rows")
        if rows:
            lines += ["", f"## {part.title}", "", table(rows, part.columns)]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {x}" for x in failures]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as logs:
        logs.add(work / "logs", arcname="logs")
