"""What `dstrain compare` and `dstrain estimate` show: markdown, CSV, PNG plots and console tables."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.plan.memory_parts import GIB, PHASES
from dstrain.precision import Precision

if TYPE_CHECKING:
    from dstrain.plan.memory_parts import Estimate


@dataclass
class Row:
    """One config of a comparison: its strategy, what its run measured, and how it ended."""

    config: str  # the ds_config's stem, which names its run folder
    status: str  # completed | interrupted | invalid config | out of memory | crashed | incomplete
    reason: str = ""  # the last error line of its log when it did not complete
    zero_stage: int | None = None
    pp_stages: int | None = None
    tp_size: int | None = None
    sp_size: int | None = None  # Ulysses sequence-parallel degree
    ep_size: int | None = None  # expert-parallel size (ds_config expert_parallel.autoep_size)
    precision: Precision | None = None
    offload: str = "none"
    micro_batch: int | None = None
    grad_accum: int | None = None
    world_size: int | None = None
    steps: int | None = None
    tokens_per_s: float | None = None  # steady state: median over the logged intervals after the first
    tflops_per_device: float | None = None
    mfu: float | None = None
    mem_peak_gib: float | None = None  # rank 0's peak (device allocator; process RSS on a CPU)
    est_mem_gib: float | None = None  # dstrain estimate's device peak for the same world size
    final_loss: float | None = None  # the last logged training loss
    loss_diff: float | None = None  # final_loss minus the first config's
    valid_loss: float | None = None  # the final evaluation
    tasks: str = ""  # the final evaluation's train.tasks: "<name> <acc>[/<acc_norm>]" each, comma-separated
    curve: list[tuple[int, float]] = field(default_factory=list, repr=False)  # (step, loss), not in the CSV
    mix: list[tuple[int, dict[str, float]]] = field(default_factory=list, repr=False)  # (step, share per source)

    @property
    def ok(self) -> bool:
        return self.status == "completed"


CSV_FIELDS = [f.name for f in fields(Row) if f.name not in ("curve", "mix")]
COLUMNS = [  # markdown header, Row attribute, format
    ("config", "config", "`{}`"),
    ("ZeRO", "zero_stage", "{}"),
    ("PP", "pp_stages", "{}"),
    ("TP", "tp_size", "{}"),
    ("SP", "sp_size", "{}"),
    ("EP", "ep_size", "{}"),
    ("precision", "precision", "{}"),
    ("offload", "offload", "{}"),
    ("micro × accum", None, None),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("TFLOP/s/device", "tflops_per_device", "{:.3g}"),
    ("MFU", "mfu", "{:.1%}"),
    ("peak mem GiB", "mem_peak_gib", "{:.2f}"),
    ("est. mem GiB", "est_mem_gib", "{:.2f}"),
    ("final loss", "final_loss", "{:.4f}"),
    ("Δ loss", "loss_diff", "{:+.2e}"),
    ("valid loss", "valid_loss", "{:.4f}"),
    ("tasks acc/norm", "tasks", "{}"),
    ("status", "status", "{}"),
    ("reason", "reason", "{}"),
]


def cell(row: Row, attr: str | None, fmt: str | None) -> str:
    if attr is None or fmt is None:
        return "—" if row.micro_batch is None else f"{row.micro_batch} × {row.grad_accum if row.grad_accum else '?'}"
    value = getattr(row, attr)
    if value is None or value == "":
        return "—"
    return fmt.format(value).replace("|", "\\|")


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({name: "" if getattr(row, name) is None else getattr(row, name) for name in CSV_FIELDS})


def write_markdown(rows: list[Row], path: Path, title: str, preamble: list[str], plots: list[str]) -> None:
    lines = [f"# {title}", "", *preamble, ""]
    lines.append("| " + " | ".join(c[0] for c in COLUMNS) + " |")
    lines.append("|" + "|".join("---" if c[2] in (None, "{}", "`{}`") else "---:" for c in COLUMNS) + "|")
    for row in rows:
        lines.append("| " + " | ".join(cell(row, attr, fmt) for _, attr, fmt in COLUMNS) + " |")
    lines.append("")
    for plot in plots:
        lines += [f"![{Path(plot).stem}]({plot})", ""]
    path.write_text("\n".join(lines))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_losses(rows: list[Row], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "x", "d", "v"]
    drawn = [row for row in rows if row.curve]
    for i, row in enumerate(drawn):  # equal curves lie on top of each other: thinner lines and other dashes on top
        steps, losses = zip(*row.curve)
        ax.plot(
            steps,
            losses,
            linestyle=styles[i % len(styles)],
            marker=markers[i % len(markers)],
            markersize=4,
            linewidth=2.5 - 1.5 * i / max(1, len(drawn)),
            label=f"{row.config} ({row.status})",
            alpha=0.9,
        )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves (equivalent strategies overlap)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_mix(rows: list[Row], path: Path) -> None:
    """The realised data mixture (metrics.jsonl's mix_<source> per interval) of the first run that logged one:
    the same recipe under every strategy reads the same samples, so one run shows them all."""
    row = next(row for row in rows if row.mix)
    names = sorted({name for _, shares in row.mix for name in shares})
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [step for step, _ in row.mix]
    ax.stackplot(steps, [[shares.get(name, 0.0) for _, shares in row.mix] for name in names], labels=names, step="pre")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of the interval's samples")
    ax.set_ylim(0, 1)
    ax.set_title(f"Realised data mixture ({row.config})")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bar_labels(ax, rows: list[Row]) -> None:
    ax.set_xticks(range(len(rows)), [r.config for r in rows], rotation=20, ha="right", fontsize=8)
    for i, row in enumerate(rows):
        if not row.ok:
            ax.annotate(
                row.status,
                (i, 0),
                ha="center",
                va="bottom",
                color="firebrick",
                fontsize=8,
                rotation=90,
                xytext=(0, 4),
                textcoords="offset points",
            )


def plot_throughput(rows: list[Row], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = [r.tokens_per_s or 0.0 for r in rows]
    bars = ax.bar(range(len(rows)), values, color=["tab:blue" if r.ok else "lightgray" for r in rows])
    ax.bar_label(bars, labels=[f"{v:,.0f}" if v else "" for v in values], fontsize=8)
    _bar_labels(ax, rows)
    ax.set_ylabel("tokens/s (steady state, all ranks)")
    ax.set_title("Throughput: median over logged intervals after the first")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(rows: list[Row], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(rows))
    width = 0.38
    measured = [r.mem_peak_gib or 0.0 for r in rows]
    estimated = [r.est_mem_gib or 0.0 for r in rows]
    ax.bar([i - width / 2 for i in x], measured, width, label="measured peak (rank 0)", color="tab:orange")
    ax.bar([i + width / 2 for i in x], estimated, width, label="dstrain estimate (device peak)", color="tab:green")
    _bar_labels(ax, rows)
    ax.set_ylabel("GiB per rank")
    ax.set_title("Memory per rank: measured beside estimated")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- dstrain estimate's console table -------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def print_estimate(est: Estimate, suggestion: Estimate | None) -> None:
    """The human-readable form of `dstrain estimate`: components by phase, the verdict, and a config that fits."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    ranks = est.nodes * est.gpus_per_node
    offloads = [("optimizer", est.offload_optimizer), ("parameter", est.offload_param)]
    offload = ", ".join(f"{k} offload to {v}" for k, v in offloads if v)
    console.print(
        f"[bold]{est.recipe}[/] under [bold]{est.ds_config}[/]: {est.nodes} node(s) x {est.gpus_per_node} devices "
        f"= {ranks} ranks (data-parallel {est.dp_size} x tensor {est.tp_size} x pipeline {est.pp_stages} "
        f"x sequence {est.sp_size})"
    )
    console.print(
        f"ZeRO-{est.zero_stage}, {est.precision}, micro-batch {est.micro_batch} x accumulation {est.grad_accum}"
        f"{', ' + offload if offload else ''}; {est.params_total:,} parameters (meta-device count = num_params), "
        f"{est.params_per_rank:,} per model-parallel rank"
    )
    if est.params_active is not None:
        console.print(
            f"mixture of experts: {est.params_active:,} active parameters per token of {est.params_total:,}; "
            f"expert-parallel {est.ep_size} (each rank holds 1/{est.ep_size} of the experts, "
            f"expert-data-parallel {est.dp_size // est.ep_size})"
        )
    console.print(memory_table(est))
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"
    console.print(
        f"{verdict}: peak {gib(est.peak())} ({est.peak_phase}) + {gib(est.reserve)} reserve "
        f"against {gib(est.device_memory)} per device"
    )
    if est.reference_pass:
        console.print(
            f"reference pass (before step 1, beside the built engine; dstrain.plan.reference_memory): "
            f"{gib(est.total('device', 'reference'))} per device against training's "
            f"{gib(max(est.total('device', phase) for phase in PHASES))}: init_from whole in fp32 on every rank "
            f"and one no-grad forward of {est.micro_batch} samples"
        )
    if est.peak("cpu"):
        console.print(f"CPU memory per node ({est.gpus_per_node} ranks): {gib(est.peak('cpu') * est.gpus_per_node)}")
    if est.peak("nvme"):
        console.print(f"NVMe per node: {gib(est.peak('nvme') * est.gpus_per_node)}")
    ref = est.deepspeed_reference
    if ref:
        console.print(
            f"DeepSpeed's {ref['function']}: {gib(ref['device'])} model states per device, "
            f"{gib(ref['cpu_per_node'])} CPU per node (mixed precision, no activations; "
            f"ours: {gib(est.model_states())} per rank)"
        )
    if suggestion is not None and suggestion.ds_config != est.ds_config:
        console.print(
            f"cheapest config that fits: [bold]{suggestion.ds_config}[/] (ZeRO-{suggestion.zero_stage}, "
            f"{suggestion.precision}, peak {gib(suggestion.peak())})"
        )
    elif suggestion is None:
        console.print(
            "no config in the configs folder fits; add nodes, raise the stage or offload, or shorten the sequence"
        )


def memory_table(est: Estimate):
    """Each component per rank in the backward and at the optimizer step, then the totals per place."""
    from rich.table import Table

    table = Table(title="memory per rank", title_justify="left")
    phases = {"backward": "backward", "step": "optimizer step", "reference": "reference pass"}
    shown = [phases[phase] for phase in est.phases]
    for name in ["group", "component", "where", *shown, "formula"]:
        table.add_column(name, justify="right" if name in shown else "left")
    for part in est.parts:
        sizes = [getattr(part, phase) for phase in est.phases]
        if any(sizes):
            table.add_row(part.group, part.name, part.where, *map(gib, sizes), part.formula)
    for where in ("device", "cpu", "nvme"):
        if est.peak(where):
            totals = [gib(est.total(where, phase)) for phase in est.phases]
            table.add_row(f"[bold]total {where}[/]", "", where, *totals, "", end_section=where == "device")
    return table
