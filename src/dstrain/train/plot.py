"""run_dir/loss.png: the train and valid loss and the learning rate of a run, drawn from its metrics.jsonl; and
beside it, for a run with train.tasks, run_dir/tasks.png: each task's accuracy at each evaluation."""

from __future__ import annotations

from pathlib import Path

from dstrain.errors import warn
from dstrain.metrics_records import read_records
from dstrain.run_dir import RunDir


def read_curves(metrics: Path) -> dict[str, list[tuple[float, float]]]:
    """(step, value) lists: ``train`` loss, ``valid`` loss, ``lr``, and the loss of each weight average
    (``valid/averaged...``, train.averaging) that the run logged; event records and cut-short lines are skipped."""
    curves: dict[str, list[tuple[float, float]]] = {"train": [], "valid": [], "lr": []}
    for record in read_records(metrics):
        if "split" not in record:
            curves["train"].append((record["step"], record["loss"]))
            curves["lr"].append((record["step"], record["lr"]))
        elif record["split"] == "valid" or record["split"].startswith("valid/averaged"):
            curves.setdefault(record["split"], []).append((record["step"], record["loss"]))
    return curves


def plot_run(files: RunDir, title: str = "") -> Path:
    """Write run_dir/loss.png from run_dir/metrics.jsonl and return its path."""
    from matplotlib.figure import Figure  # without pyplot: no display backend, a third of the import time

    curves = read_curves(files.metrics)
    fig = Figure(figsize=(8, 5.5))
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    averages = [(name, "s--") for name in curves if name.startswith("valid/averaged")]
    for name, style in (("train", ".-"), ("valid", "o-"), *averages):  # markers: one logged step still shows
        if curves[name]:
            loss_ax.plot(*zip(*curves[name]), style, label=f"{name} loss", markersize=4)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(title or files.root.name)
    loss_ax.grid(alpha=0.3)
    if loss_ax.lines:
        loss_ax.legend()
    if curves["lr"]:
        lr_ax.plot(*zip(*curves["lr"]), ".-", color="tab:green", markersize=4)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.xaxis.get_major_locator().set_params(integer=True)
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    path = files.loss_plot
    fig.savefig(path, dpi=100)  # the Agg canvas, chosen by the file name
    return path


def read_task_curves(metrics: Path) -> dict[str, list[tuple[float, float]]]:
    """(step, value) lists of each ``task/<name>/acc`` and ``acc_norm`` of the ``valid`` records."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for record in read_records(metrics):
        if record.get("split") != "valid":
            continue
        for key, value in record.items():
            if key.startswith("task/") and key.endswith(("/acc", "/acc_norm")):
                curves.setdefault(key.removeprefix("task/"), []).append((record["step"], float(value)))  # type: ignore[arg-type]
    return curves


def plot_tasks(files: RunDir, title: str = "") -> Path | None:
    """Write run_dir/tasks.png (acc solid, acc_norm dashed, one colour per task); None when no task was logged."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    curves = read_task_curves(files.metrics)
    if not curves:
        return None
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    colours: dict[str, str] = {}
    for key, points in curves.items():
        name, metric = key.rsplit("/", 1)
        colour = colours.setdefault(name, f"C{len(colours) % 10}")
        style = "o-" if metric == "acc" else "s--"
        ax.plot(*zip(*points), style, color=colour, label=f"{name} {metric}", markersize=4)
    ax.set_ylabel("accuracy")
    ax.set_xlabel("optimizer step")
    ax.set_title(title or files.root.name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path = files.tasks_plot
    fig.savefig(path, dpi=100)
    return path


def try_plot_run(files: RunDir, title: str = "") -> Path | None:
    """plot_run (and plot_tasks), where a failure (no matplotlib, a broken metrics file) is a warning: a picture
    never fails a run."""
    try:
        path = plot_run(files, title)
        plot_tasks(files, title)
        return path
    except Exception as e:  # noqa: BLE001
        warn(f"could not draw {files.loss_plot}: {type(e).__name__}: {e}")
        return None
