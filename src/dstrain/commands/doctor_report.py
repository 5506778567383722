"""`dstrain doctor`'s verdict: each strategy's losses and pre-clip gradient norms against ZeRO-0's, step by step,
beside the tolerance its precision implies; the kernel checks; report.md, doctor.json and doctor.png.

Tolerances (relative, per step, on the loss and on the pre-clip gradient norm):
- fp32: the larger of FP32_RTOL and TWIN_FACTOR times what ZeRO-0 differs from itself under another micro-batch
  split (the same gradients summed in another order). Reordered fp32 sums differ in the last units of 2^-24; ten steps
  of Adam carry that to ~1e-7 on the losses, and a step where the loss surface is sharp can carry it to ~1e-6 on that
  step's norm, for ZeRO-0 against itself as much as for any strategy (docs/troubleshooting.md has the figures).
- bf16 and fp16 against fp32 ZeRO-0: LOW_PRECISION_RTOL. Each rounding to bf16 costs up to 2^-9 = 2e-3 of a value;
  ten steps of ZeRO-1 bf16 on doctor's model measured 4.8e-5 on the losses and 3.9e-3 on the norms (2 CPU ranks).
A silent gradient defect (one bucket scaled wrongly, a gradient divided by the loss scale twice, a lost
micro-batch) moves the norms by 1e-2 to 1e5 relative from its first step; Adam hides a uniform scale in the losses
but not in the norms, which is why both are compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dstrain.commands.report import _pyplot
from dstrain.metrics_records import read_records
from dstrain.run_dir import RunDir

BASELINE = "zero0"
TWIN = "zero0_reordered"  # ZeRO-0 with another micro-batch split: the same math, its sums in another order
FP32_RTOL = 1e-6
TWIN_FACTOR = 10.0
LOW_PRECISION_RTOL = 2e-2


@dataclass
class Verdict:
    """One strategy against ZeRO-0."""

    name: str
    config: str
    status: str  # ok | MISMATCH | failed | cannot run here | baseline
    precision: str = ""
    reason: str = ""
    max_loss_diff: float | None = None  # absolute, over the steps
    max_loss_rel: float | None = None
    max_norm_rel: float | None = None  # pre-clip gradient norm, relative
    tolerance: float | None = None
    first_diverging_step: int | None = None
    loss_rel: list[float] = field(default_factory=list)  # per step
    norm_rel: list[float] = field(default_factory=list)


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


def compare(name: str, config: str, records: list[dict], reference: list[dict], tolerance: float) -> Verdict:
    verdict = Verdict(name, config, "ok", tolerance=tolerance)
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
    for step, (loss, norm) in enumerate(zip(verdict.loss_rel, verdict.norm_rel), 1):
        if not (loss <= tolerance and norm <= tolerance):  # NaN is a mismatch too
            verdict.status, verdict.first_diverging_step = "MISMATCH", step
            verdict.reason = f"step {step}: loss {loss:.2e}, grad norm {norm:.2e} relative (tolerance {tolerance:.0e})"
            break
    return verdict


def failure_reason(run_dir: Path, code: int | None) -> str:
    error = run_dir / "doctor_error.txt"
    if error.is_file():
        return error.read_text().strip().splitlines()[-1][:300]
    return f"exit status {code}; see launcher.log" if code is not None else "did not run; see launcher.log"


def verdicts(out: Path, runs: list[dict], refused: dict[str, str]) -> tuple[list[Verdict], float]:
    """Every run's verdict (the baseline's and twin's first) and the fp32 tolerance the twin set."""
    codes_file = out / "codes.json"
    codes = json.loads(codes_file.read_text()) if codes_file.is_file() else {}
    reference = train_records(out / "runs" / BASELINE)
    twin = compare(TWIN, "", train_records(out / "runs" / TWIN), reference, math.inf)
    floor = max([*twin.loss_rel, *twin.norm_rel], default=0.0)
    fp32 = max(FP32_RTOL, TWIN_FACTOR * floor)
    found = [Verdict(BASELINE, runs[0]["config"], "baseline" if reference else "failed", "fp32")]
    if not reference:
        found[0].reason = failure_reason(out / "runs" / BASELINE, codes.get(BASELINE))
    for run in runs[1:]:
        folder = out / "runs" / run["name"]
        precision = precision_of_run(folder, run["config"])
        tolerance = fp32 if precision == "fp32" else LOW_PRECISION_RTOL
        verdict = compare(run["name"], run["config"], train_records(folder), reference, tolerance)
        verdict.precision = precision
        if codes.get(run["name"]) not in (0, None) or verdict.status == "failed":
            verdict.status = "failed"
            verdict.reason = verdict.reason or failure_reason(folder, codes.get(run["name"]))
        found.append(verdict)
    found += [Verdict(name, "", "cannot run here", reason=why) for name, why in refused.items()]
    return found, fp32


def fmt(value: float | None, spec: str = ".1e") -> str:
    return "" if value is None else format(value, spec)


def markdown(found: list[Verdict], checks: list[dict], context: dict, fp32: float) -> str:
    lines = [
        "# dstrain doctor",
        "",
        f"Recipe `{context['recipe']}` at doctor's size, {context['steps']} steps on {context['ranks']} ranks, one "
        f"launch. Versions: {context.get('versions', '')}.",
        "",
        f"Tolerance (relative, every step, loss and pre-clip gradient norm): fp32 {fp32:.1e} (the larger of "
        f"{FP32_RTOL:.0e} and {TWIN_FACTOR:g} x ZeRO-0 against itself with another micro-batch split); bf16 and "
        f"fp16 {LOW_PRECISION_RTOL:.0e} against fp32 ZeRO-0.",
        "",
        "| strategy | precision | status | max abs Δ loss | max rel Δ loss | max rel Δ grad norm | tolerance "
        "| first diverging step | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in found:
        lines.append(
            f"| `{v.name}` | {v.precision} | {v.status} | {fmt(v.max_loss_diff)} | {fmt(v.max_loss_rel)} | "
            f"{fmt(v.max_norm_rel)} | {fmt(v.tolerance)} | {v.first_diverging_step or ''} | "
            f"{v.reason.replace('|', '/')} |"
        )
    lines += ["", "| check | value | tolerance | ok | what |", "|---|---|---|---|---|"]
    for c in checks:
        value = fmt(c["value"], ".3g") if c["value"] is not None else "n/a"
        lines.append(f"| {c['name']} | {value} | {fmt(c['tolerance'])} | {c['ok']} | {c['detail']} |")
    if "planned_bandwidth" in context:
        lines += ["", f"Bandwidths are bus Gbit/s as nccl-tests count them; {context['planned_bandwidth']}."]
    return "\n".join([*lines, "", "![differences per step](doctor.png)", ""])


def plot(found: list[Verdict], fp32: float, path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in ((axes[0], "loss_rel", "relative Δ loss"), (axes[1], "norm_rel", "relative Δ grad norm")):
        for v in found:
            values = getattr(v, key)
            if values:
                style = "-" if v.status != "MISMATCH" else "--"
                ax.plot(range(1, len(values) + 1), [max(x, 1e-12) for x in values], style, marker=".", label=v.name)
        ax.axhline(fp32, color="black", linewidth=0.8, label="fp32 tolerance")
        ax.axhline(LOW_PRECISION_RTOL, color="grey", linewidth=0.8, linestyle=":", label="bf16/fp16 tolerance")
        ax.set(yscale="log", xlabel="step", title=f"{title} against ZeRO-0")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    diverged = [f"{v.name} from step {v.first_diverging_step}" for v in found if v.status == "MISMATCH"]
    figure.suptitle("outside tolerance: " + ", ".join(diverged) if diverged else "every strategy within tolerance")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def versions() -> str:
    import deepspeed
    import torch

    return f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}"


def build_report(out: Path, runs: list[dict], refused: dict[str, str], context: dict) -> int:
    """Write report.md, doctor.json and doctor.png; print the table; 1 if anything is outside its tolerance."""
    found, fp32 = verdicts(out, runs, refused)
    checks_file = out / "checks.json"
    checks = json.loads(checks_file.read_text()) if checks_file.is_file() else []
    context = {**context, "versions": versions()}
    text = markdown(found, checks, context, fp32)
    (out / "report.md").write_text(text)
    payload = {"context": context, "fp32_tolerance": fp32, "strategies": [asdict(v) for v in found], "checks": checks}
    (out / "doctor.json").write_text(json.dumps(payload, indent=1))
    plot(found, fp32, out / "doctor.png")
    print(text.split("![")[0].rstrip())
    bad = [v.name for v in found if v.status in ("MISMATCH", "failed")] + [c["name"] for c in checks if not c["ok"]]
    if not checks:
        bad.append("kernel checks (none ran; see launcher.log)")
    print(f"{out / 'report.md'}: " + (f"outside tolerance: {', '.join(bad)}" if bad else "every strategy agrees"))
    return 1 if bad else 0
