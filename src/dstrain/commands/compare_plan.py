"""``dstrain compare --plan K``: the K fastest layouts the planner predicts for this machine (calibrated, DeepSpeed's
engines included), run like any compared configs, with the predicted step time beside the measured one.

The runs take turns in three stretches each (dstrain.commands.compare.run_interleaved), so that the shared
machine's load changes fall on all of them. Measured step time: the recipe's tokens per step over the run's steady
tokens/s (the median over the logged steps, the first of each stretch left out). Noise: the spread of a run's own
per-step times (half its interquartile range over the median); the fastest predicted layout counts as the fastest
measured when the two differ by less than the larger spread of the two runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dstrain.config import Recipe
from dstrain.errors import InputError
from dstrain.run_dir import RunDir


def write_planned(recipe: Recipe, nproc: int, k: int, out: Path) -> tuple[list[str], dict]:
    """The K fastest layouts for nproc ranks on this machine as ds_config files in OUT/planned/, and the predicted
    seconds per step of each (by stem)."""
    from dstrain.commands.calibrate_engine import with_engine_costs
    from dstrain.plan.calibrate import calibrated_device
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import Cluster

    cluster = Cluster(with_engine_costs(recipe, calibrated_device(recipe, nproc), nproc), 1, nproc)
    kept, _ = plan(recipe, cluster, "fp32", k, torch_adam=True)
    if not kept:
        raise InputError(f"no layout dstrain accepts fits {nproc} ranks of this machine", input="recipe")
    return write_configs(kept, out)


def write_configs(kept: list, out: Path) -> tuple[list[str], dict]:
    """Planned layouts as ds_config files in OUT/planned/, and the predicted seconds per step of each (by stem)."""
    folder = out / "planned"
    folder.mkdir(parents=True, exist_ok=True)
    configs, predicted = [], {}
    for i, p in enumerate(kept, 1):
        stem = f"plan{i}_" + p.layout.describe().replace(" ", "_").replace("+", "_").lower() + f"_m{p.layout.micro}"
        path = folder / f"{stem}.json"
        path.write_text(json.dumps(p.ds_config, indent=2) + "\n")
        configs.append(str(path))
        predicted[stem] = p.prediction.step_s
    return configs, predicted


def step_seconds(run_dir: Path, tokens_per_step: int) -> list[float]:
    """Seconds of each logged training step (from tokens/s of one-step log intervals), leaving out the first step of
    the run and of each resumed stretch (warm-up)."""
    metrics = RunDir(run_dir).metrics
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    seconds, warm = [], False
    for record in (json.loads(line) for line in lines if line.strip()):
        if "event" in record:
            warm = False  # a resume: the next step warms up again
        elif "split" not in record and record.get("tokens_per_s"):
            if warm:
                seconds.append(tokens_per_step / record["tokens_per_s"])
            warm = True
    return seconds


def prediction_lines(out: Path, predicted: dict, tokens_per_step: int) -> list[str]:
    """A markdown table: predicted beside measured seconds per step, and whether the fastest was picked."""
    lines = ["| layout | predicted s/step | measured s/step | measured / predicted | spread |", "|---|---|---|---|---|"]
    measured: dict[str, tuple[float, float]] = {}
    for stem, seconds in predicted.items():
        steps = step_seconds(out / stem, tokens_per_step)
        if len(steps) < 4:
            lines.append(f"| {stem} | {seconds:.3f} | - | - | - |")
            continue
        median = statistics.median(steps)
        q1, _, q3 = statistics.quantiles(steps, n=4)
        measured[stem] = (median, (q3 - q1) / 2 / median)
        lines.append(f"| {stem} | {seconds:.3f} | {median:.3f} | {median / seconds:.2f} | ±{measured[stem][1]:.0%} |")
    if measured:
        first = next(iter(predicted))
        fastest = min(measured, key=lambda s: measured[s][0])
        if first in measured:
            gap = measured[first][0] / measured[fastest][0] - 1
            noise = max(measured[first][1], measured[fastest][1])
            verdict = "is" if first == fastest else ("within noise of" if gap <= noise else "is NOT")
            lines += [
                "",
                f"Fastest predicted `{first}` {verdict} the fastest measured `{fastest}` "
                f"({gap:+.0%}, noise ±{noise:.0%}).",
            ]
    return lines
