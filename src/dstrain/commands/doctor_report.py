"""`dstrain doctor`'s verdict: each strategy's losses and pre-clip gradient norms against the baseline in its
precision, step by step, beside a per-step tolerance from that baseline's twin; the gradient checks of the ranks'
probes (dstrain.commands.doctor_checks); the kernel checks; report.md, doctor.json and doctor.png.

Baselines: ZeRO-0 in fp32; ZeRO-1 in bf16 and fp16 (strategy.resolve refuses ZeRO-0 there: it would sum the gradients
in bf16), itself held to LOW_PRECISION_RTOL of fp32 ZeRO-0. Tolerances (relative, per step, on the loss and on the
pre-clip gradient norm), from the twin: the baseline at another micro-batch, the same gradients summed in another
order. At step s a strategy may differ from
ZeRO-0 by FACTOR[precision] times the twin's largest difference over steps s-1..s+1 (a sharp step of the loss surface
amplifies a last-bit difference on that step and its neighbour, for ZeRO-0 against itself as for any strategy), and
never less than FLOOR[precision]:
- fp32: reordered fp32 sums differ in the last units of 2^-24; ten steps of Adam carry that to ~1e-7 on the losses
  and a sharp step to ~1e-5 on that step's norm at a recipe's own size (tiny.yaml's step 7: docs/troubleshooting.md).
- bf16 (fp16 alike): a bf16 rounding costs up to 2^-9 = 2e-3 of a value; ZeRO-1 bf16 against itself at another
  micro-batch differs by up to 1.9e-3 on the norms (10 steps, 2 CPU ranks), as much as any clean strategy, so a
  defect of a few percent on one rank (DeepSpeed#7985's rank drift: ~2% on the norm) is outside, where the former
  fixed 2e-2 against fp32 let it by.
A silent gradient defect (one bucket scaled wrongly, a lost micro-batch, a wrong divisor) moves the norms by 1e-2 to
1e5 relative from its first step; Adam hides a uniform scale in the losses but not in the norms, so both are compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dstrain.commands.doctor_catalogue import features_of, warnings
from dstrain.commands.doctor_checks import CheckRow, gradient_checks
from dstrain.commands.report import _pyplot
from dstrain.metrics_records import read_records
from dstrain.run_dir import RunDir

FACTOR = {"fp32": 10.0, "bf16": 3.0, "fp16": 3.0}
FLOOR = {"fp32": 1e-6, "bf16": 2e-3, "fp16": 2e-3}
# The most a twin may differ from its baseline, and a half-precision baseline from fp32 ZeRO-0: beyond it the
# baseline's own accumulation is broken and would widen every tolerance (fp32: 1e-5 measured at tiny.yaml's size).
TWIN_LIMIT = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
LOW_PRECISION_RTOL = 2e-2  # a bf16 rounding is up to 2^-9 = 2e-3; ZeRO-1 bf16 measured 1.7e-3 from fp32 ZeRO-0


@dataclass
class Verdict:
    """One run against its baseline (ZeRO-0 in its precision)."""

    name: str
    config: str
    status: str  # ok | MISMATCH | failed | cannot run here | baseline | twin
    precision: str = ""
    reason: str = ""
    baseline: str = ""
    accumulation: int | None = None
    max_loss_diff: float | None = None  # absolute, over the steps
    max_loss_rel: float | None = None
    max_norm_rel: float | None = None  # pre-clip gradient norm, relative
    tolerance: float | None = None  # the largest of the per-step tolerances
    first_diverging_step: int | None = None
    loss_rel: list[float] = field(default_factory=list)  # per step
    norm_rel: list[float] = field(default_factory=list)
    tolerances: list[float] = field(default_factory=list)  # per step


def train_records(run_dir: Path) -> list[dict]:
    records = read_records(RunDir(run_dir).metrics) if RunDir(run_dir).metrics.is_file() else []
    by_step = {r["step"]: dict(r) for r in records if "split" not in r}  # a resume logs its steps after the stop again
    return [by_step[s] for s in sorted(by_step)]


def precision_of_run(run_dir: Path, config: str) -> str:
    from dstrain.strategy.resolve import precision_of

    resolved = RunDir(run_dir).ds_config
    source = resolved if resolved.is_file() else Path(config.split(" then ")[0])
    try:
        return precision_of(json.loads(source.read_text()))
    except (OSError, ValueError):
        return "fp32"


def relative_diffs(got: list[dict], want: list[dict], key: str) -> list[float]:
    return [abs(g[key] - w[key]) / max(abs(w[key]), 1e-30) for g, w in zip(got, want)]


def per_step_tolerances(drift: list[float], precision: str) -> list[float]:
    """FACTOR x the twin's largest difference over steps s-1..s+1, at least FLOOR (module doc)."""
    factor, floor = FACTOR.get(precision, FACTOR["bf16"]), FLOOR.get(precision, FLOOR["bf16"])
    tolerances = []
    for step in range(len(drift)):
        near = drift[max(0, step - 1) : step + 2]
        worst = math.nan if any(math.isnan(x) for x in near) else max(near)
        tolerances.append(max(floor, factor * worst) if math.isfinite(worst) else math.nan)  # NaN: a mismatch
    return tolerances


def compare(name: str, config: str, records: list[dict], reference: list[dict], tolerances: list[float]) -> Verdict:
    verdict = Verdict(name, config, "ok", tolerances=tolerances)
    verdict.tolerance = max(tolerances, default=None)
    if len(records) != len(reference) or not records:
        verdict.status, verdict.reason = "failed", f"logged {len(records)} of {len(reference)} steps"
        return verdict
    if any(r.get("grad_norm") is None for r in records + reference):
        verdict.status, verdict.reason = "failed", "a step logged no pre-clip gradient norm"
        return verdict
    verdict.loss_rel = relative_diffs(records, reference, "loss")
    verdict.norm_rel = relative_diffs(records, reference, "grad_norm")
    verdict.max_loss_diff = max(abs(g["loss"] - w["loss"]) for g, w in zip(records, reference))
    verdict.max_loss_rel, verdict.max_norm_rel = max(verdict.loss_rel), max(verdict.norm_rel)
    for step, (loss, norm, tolerance) in enumerate(zip(verdict.loss_rel, verdict.norm_rel, tolerances), 1):
        if not (loss <= tolerance and norm <= tolerance):  # NaN is a mismatch too
            verdict.status, verdict.first_diverging_step = "MISMATCH", step
            verdict.reason = f"step {step}: loss {loss:.2e}, grad norm {norm:.2e} relative (tolerance {tolerance:.1e})"
            break
    return verdict


def failure_reason(run_dir: Path, code: int | None) -> str:
    """The last line of the first rank's error that is not a collective's timeout (the ranks left waiting for the
    one that failed time out too)."""
    errors = sorted((run_dir.parent.parent / "errors").glob(f"{run_dir.name}.rank*.txt"))
    lines = [e.read_text().strip().splitlines()[-1][:300] for e in errors if e.read_text().strip()]
    if lines:
        first = [line for line in lines if not any(word in line.lower() for word in ("timed out", "timeout"))]
        return (first or lines)[0]
    return f"exit status {code}; see launcher.log" if code is not None else "did not run; see launcher.log"


def twin_drift(out: Path, run: dict, by_name: dict[str, dict]) -> list[float]:
    """Per step, the larger relative difference (loss, norm) of ``run``'s twin from the twin's own baseline."""
    twin = by_name.get(run["twin"])
    if twin is None:
        return []
    got, want = train_records(out / "runs" / twin["name"]), train_records(out / "runs" / twin["baseline"])
    if not got or len(got) != len(want) or any(r.get("grad_norm") is None for r in got + want):
        return []
    return [max(a, b) for a, b in zip(relative_diffs(got, want, "loss"), relative_diffs(got, want, "grad_norm"))]


def verdict_of(out: Path, run: dict, by_name: dict[str, dict], codes: dict) -> Verdict:
    folder = out / "runs" / run["name"]
    precision = precision_of_run(folder, run["config"])
    records, reference = train_records(folder), train_records(out / "runs" / run["baseline"])
    if run.get("role") == "baseline" and run["baseline"] == run["name"]:
        verdict = Verdict(run["name"], run["config"], "baseline" if records else "failed")
    elif run.get("role") in ("baseline", "twin"):  # held to a fixed bound: it sets the others' tolerances
        limit = LOW_PRECISION_RTOL if run["role"] == "baseline" else TWIN_LIMIT.get(precision, LOW_PRECISION_RTOL)
        verdict = compare(run["name"], run["config"], records, reference, [limit] * len(records))
        verdict.status = run["role"] if verdict.status == "ok" else verdict.status
    else:
        drift = twin_drift(out, run, by_name)
        tolerances = per_step_tolerances(drift, precision) if drift else [math.nan] * len(records)  # no twin: fail
        verdict = compare(run["name"], run["config"], records, reference, tolerances)
    verdict.precision, verdict.baseline = precision, run.get("baseline", "")
    verdict.accumulation = run.get("accumulation")
    if codes.get(run["name"]) not in (0, None):
        verdict.status, verdict.reason = "failed", failure_reason(folder, codes.get(run["name"]))
    elif verdict.status == "failed":
        verdict.reason = verdict.reason or failure_reason(folder, codes.get(run["name"]))
    return verdict


def verdicts(out: Path, runs: list[dict], refused: dict[str, str]) -> list[Verdict]:
    """Every run's verdict, then the refusals."""
    codes_file = out / "codes.json"
    codes = json.loads(codes_file.read_text()) if codes_file.is_file() else {}
    by_name = {run["name"]: run for run in runs}
    found = [verdict_of(out, run, by_name, codes) for run in runs]
    return found + [Verdict(name, "", "cannot run here", reason=why) for name, why in refused.items()]


def fmt(value: float | None, spec: str = ".1e") -> str:
    return "" if value is None else format(value, spec)


def tolerance_range(v: Verdict) -> str:
    finite = [t for t in v.tolerances if math.isfinite(t)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    return fmt(low) if low == high else f"{fmt(low)}–{fmt(high)}"


def strategy_lines(found: list[Verdict]) -> list[str]:
    lines = [
        "| strategy | precision | accumulation | status | max abs Δ loss | max rel Δ loss | max rel Δ grad norm "
        "| tolerance per step | first diverging step | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in found:
        lines.append(
            f"| `{v.name}` | {v.precision} | {v.accumulation or ''} | {v.status} | {fmt(v.max_loss_diff)} | "
            f"{fmt(v.max_loss_rel)} | {fmt(v.max_norm_rel)} | {tolerance_range(v)} | "
            f"{v.first_diverging_step or ''} | {v.reason.replace('|', '/')} |"
        )
    return lines


def check_lines(rows: list[CheckRow], kernels: list[dict]) -> list[str]:
    lines = ["| check | status | runs checked | worst | tolerance | failures | what |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        failures = "; ".join(row.failures) or row.note
        lines.append(
            f"| {row.name} | {row.status} | {len(row.checked)} | {fmt(row.worst)} | {fmt(row.tolerance)} | "
            f"{failures.replace('|', '/')} | {row.what} |"
        )
    lines += ["", "| kernel check | value | tolerance | ok | what |", "|---|---|---|---|---|"]
    for c in kernels:
        value = fmt(c["value"], ".3g") if c["value"] is not None else "n/a"
        lines.append(f"| {c['name']} | {value} | {fmt(c['tolerance'])} | {c['ok']} | {c['detail']} |")
    return lines


def markdown(found: list[Verdict], rows: list[CheckRow], kernels: list[dict], context: dict) -> str:
    tolerances = ", ".join(f"{p} {FACTOR[p]:g} x the twin, at least {FLOOR[p]:.0e}" for p in FACTOR)
    lines = [
        "# dstrain doctor",
        "",
        f"Recipe `{context['recipe']}` at {context.get('size', 'the small')} size, {context['steps']} steps on "
        f"{context['ranks']} ranks, one launch ({fmt(context.get('wall_s'), '.0f')} s wall, "
        f"{fmt(context.get('cpu_s'), '.0f')} s CPU). Installed: {context.get('versions', '')}.",
        *[f"\n{w}" for w in context.get("warnings", [])],
        "",
        "Each strategy against ZeRO-0 in its precision (`baseline`); tolerance per step, relative, on the loss and "
        f"the pre-clip gradient norm: the twin's (`twin`: ZeRO-0 at another micro-batch) difference over that step "
        f"and its neighbours times a factor ({tolerances}).",
        "",
        *strategy_lines(found),
        "",
        *[f"Note: {note}." for note in context.get("notes", [])],
        "",
        *check_lines(rows, kernels),
    ]
    if "planned_bandwidth" in context:
        lines += ["", f"Bandwidths are bus Gbit/s as nccl-tests count them; {context['planned_bandwidth']}."]
    return "\n".join([*lines, "", "![differences per step](doctor.png)", ""])


def plot(found: list[Verdict], path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in ((axes[0], "loss_rel", "relative Δ loss"), (axes[1], "norm_rel", "relative Δ grad norm")):
        for v in found:
            values = getattr(v, key)
            if values:
                style = "-" if v.status != "MISMATCH" else "--"
                ax.plot(range(1, len(values) + 1), [max(x, 1e-12) for x in values], style, marker=".", label=v.name)
        for v in found:
            if v.status == "twin":  # the tolerance each twin sets, per step (a half-precision twin's own baseline)
                steps = range(1, len(v.loss_rel) + 1)
                line = per_step_tolerances([max(a, b) for a, b in zip(v.loss_rel, v.norm_rel)], v.precision)
                ax.step(steps, line, where="mid", color="black", linewidth=0.8, label=f"{v.precision} tolerance")
        ax.set(yscale="log", xlabel="step", title=f"{title} against ZeRO-0")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    diverged = [f"{v.name} from step {v.first_diverging_step}" for v in found if v.status == "MISMATCH"]
    figure.suptitle("outside tolerance: " + ", ".join(diverged) if diverged else "every strategy within tolerance")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def versions() -> tuple[str, str]:
    import deepspeed
    import torch

    return deepspeed.__version__, torch.__version__


def failures(found: list[Verdict], rows: list[CheckRow], kernels: list[dict], context: dict) -> list[str]:
    bad = [f"{v.name} ({v.status.lower()}{', step ' + str(v.first_diverging_step) if v.first_diverging_step else ''})"
           for v in found if v.status in ("MISMATCH", "failed")]  # fmt: skip
    bad += [f"{row.name}: {failure}" for row in rows for failure in row.failures]
    bad += [c["name"] for c in kernels if not c["ok"]]
    if not kernels and not context.get("quick"):
        bad.append("kernel checks (none ran; see launcher.log)")
    return bad


def build_report(out: Path, runs: list[dict], refused: dict[str, str], context: dict) -> int:
    """Write report.md, doctor.json and doctor.png; print the tables; 1 if anything is outside its tolerance."""
    found = verdicts(out, runs, refused)
    precisions = {v.name: v.precision for v in found}
    rows = gradient_checks(out, runs, precisions, {v.name: v.tolerances for v in found})
    checks_file = out / "checks.json"
    kernels = json.loads(checks_file.read_text()) if checks_file.is_file() else []
    deepspeed_version, torch_version = versions()
    context = {**context, "versions": f"DeepSpeed {deepspeed_version}, torch {torch_version}"}
    context["warnings"] = warnings(deepspeed_version, features_of(runs, context.get("tied_recipe", False)))
    text = markdown(found, rows, kernels, context)
    (out / "report.md").write_text(text)
    payload = {"context": context, "strategies": [asdict(v) for v in found], "checks": kernels}
    payload["gradient_checks"] = [{**asdict(r), "status": r.status} for r in rows]
    (out / "doctor.json").write_text(json.dumps(payload, indent=1))
    plot(found, out / "doctor.png")
    print(text.split("![")[0].rstrip())
    bad = failures(found, rows, kernels, context)
    print(f"{out / 'report.md'}: " + (f"outside tolerance: {'; '.join(bad)}" if bad else "every strategy agrees"))
    return 1 if bad else 0
