"""``dstrain compare``: one recipe under several ds_configs, and one report of speed, memory and loss.

    dstrain compare --recipe R --deepspeed_configs C1 C2 ... [--nproc N] [--steps S] --out DIR [key=value ...]
    dstrain compare --collect DIR [--deepspeed_configs C1 C2 ...] [--recipe R]

A config may carry recipe overrides of its own, joined by "+": ``ds_configs/zero0.json+optim.kind=muon`` runs the
recipe with Muon in ``DIR/zero0+optim.kind=muon/``, beside ``ds_configs/zero0.json`` with AdamW; the row is named so.

The first form runs each config, one after another, through the ``deepspeed`` launcher into
``DIR/<config stem>/`` (its full output in ``launcher.log``); the second builds the report from run
folders that already exist there, e.g. those of the Slurm array ``slurm/compare.sbatch``. The recipe
fixes global batch, schedule and data order, so every config trains on the same samples and the
equivalent strategies end on the same loss. A config that fails keeps its row with the reason; the
others still run. DIR gets ``report.md``, ``results.csv``, ``loss.png``, ``throughput.png``, ``memory.png``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dstrain.commands.compare_runs import LOG_NAME, find_log, read_run
from dstrain.commands.report import (
    GIB,
    Row,
    plot_losses,
    plot_memory,
    plot_mix,
    plot_throughput,
    write_csv,
    write_markdown,
)
from dstrain.errors import DstrainError, naming_files
from dstrain.options import given
from dstrain.run_dir import RunDir

THROUGHPUT_NOTE = (
    "Throughput (tokens/s over all ranks, TFLOP/s per device, MFU) is the steady state: the median over the "
    "logged intervals after the first, which includes start-up; with a single logged interval, that interval."
)


# --- running ------------------------------------------------------------------------------------------


PLAN_ROUNDS = 3  # --plan: each run in this many stretches, the runs taking turns (run_interleaved)


def launcher() -> str:
    """The deepspeed launcher of this interpreter's environment (a venv's bin/ need not be on PATH)."""
    beside = Path(sys.executable).parent / "deepspeed"
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if not found:
        raise DstrainError("the deepspeed launcher is not installed in this environment; pip install deepspeed")
    return found


def run_overrides(overrides: list[str], steps: int | None) -> list[str]:
    """The user's overrides, plus --steps, plus one log line per step for a steady-state median."""
    extra = [] if any(o.startswith("train.log_interval=") for o in overrides) else ["train.log_interval=1"]
    if steps is not None:
        extra += [f"train.steps={steps}", "train.tokens=null"]
    return [*overrides, *extra]


def launch(recipe: str, config: str, run_dir: Path, nproc: int, overrides: list[str]) -> int:
    """One config through the deepspeed launcher; everything it prints goes to run_dir/launcher.log."""
    from dstrain.train.process.distributed import free_port

    command = [
        launcher(),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        "--module",
        "dstrain.train",
        "--recipe",
        recipe,
        "--deepspeed_config",
        config,
        f"run_dir={run_dir}",
        *overrides,
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / LOG_NAME).open("a") as log:  # a run launched again (--plan's rounds) keeps its earlier output
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode


def split_entries(values: list[str]) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """--deepspeed_configs' values as (run name, ds_config, its own recipe overrides), and the plain overrides that
    nargs="+" swallowed: ``C.json+k=v+k2=v2`` is C with overrides k=v and k2=v2, run as ``<stem>+k=v+k2=v2``."""
    entries, overrides = [], []
    for value in values:
        config, *extra = value.split("+")
        if "=" in config:  # a ds_config path has no "=": a plain override for every run
            overrides.append(value)
            continue
        bad = [e for e in extra if "=" not in e]
        if bad:
            raise DstrainError(f"--deepspeed_configs {value}: {bad[0]!r} is no key=value; write C.json+optim.kind=muon")
        entries.append(("+".join([Path(config).stem, *extra]), config, extra))
    return entries, overrides


def run_all(recipe: str, entries: list, out: Path, nproc: int, overrides: list[str]) -> None:
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    for i, (stem, config, extra) in enumerate(entries, 1):
        start = time.time()
        with console.status(f"[{i}/{len(entries)}] {stem}: running on {nproc} ranks ({out / stem / LOG_NAME})"):
            launch(recipe, config, out / stem, nproc, [*overrides, *extra])
        row = read_run(out / stem)
        done = (
            f"{row.tokens_per_s or 0:,.0f} tokens/s, final loss {row.final_loss or float('nan'):.4f}"
            if row.ok
            else row.reason
        )
        mark = "[green]ok[/]" if row.ok else "[red]failed[/]"
        seconds = time.time() - start
        console.print(f"[{i}/{len(entries)}] {stem}: {mark} {row.status} in {seconds:.0f} s: {done}", highlight=False)


def holds_a_run(folder: Path) -> bool:
    """A config's run was here: its run folder's records or the launcher's log."""
    return any(path.exists() for path in (*RunDir(folder).records, folder / LOG_NAME))


def run_interleaved(recipe: str, entries: list, out: Path, nproc: int, overrides: list[str], steps: int) -> None:
    """The runs take turns, PLAN_ROUNDS stretches of steps each (each resumes its last checkpoint), so that a change
    of this machine's load falls on every run alike rather than on whichever ran then."""
    for r in range(1, PLAN_ROUNDS + 1):
        run_all(recipe, entries, out, nproc, [*overrides, f"train.steps={steps * r // PLAN_ROUNDS}"])


def check_fresh(out: Path, entries: list) -> None:
    """Refuse before running anything: duplicate run names, or run folders that already hold a run."""
    stems = [stem for stem, _, _ in entries]
    for stem in stems:
        if stems.count(stem) > 1:
            clash = [config for name, config, _ in entries if name == stem]
            raise DstrainError(
                f"--deepspeed_configs {' and '.join(clash)} share the run folder {out / stem}; rename one"
            )
        if holds_a_run(out / stem):
            raise DstrainError(
                f"{out / stem} already holds a run; choose another --out, remove it, "
                f"or rebuild the report with --collect {out}"
            )


def check_counts(nproc: int | None, steps: int | None) -> None:
    if nproc is not None and nproc < 1:
        raise DstrainError(
            f"--nproc {nproc}: the ranks per run must be a positive integer; leave it out for every local device"
        )
    if steps is not None and steps < 1:
        raise DstrainError(
            f"--steps {steps}: the steps per run must be a positive integer; leave it out for the recipe's"
        )


def check_configs(recipe_file: str, entries: list, overrides: list[str], nproc: int) -> None:
    """Resolve every config against its recipe for nproc ranks now, so that none is launched only to be refused."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, resolve

    for _, config, extra in entries:
        recipe = load_recipe_and_source(recipe_file, [*overrides, *extra])[0]
        resolve(recipe, recipe_file, load_ds_config(config), config, nproc)


# --- the report -----------------------------------------------------------------------------------------


def add_estimates(
    rows: list[Row],
    out: Path,
    recipe_file: str | None,
    overrides: list[str],
    nproc: int | None,
    sources: dict[str, str],
) -> None:
    """The estimated device peak of each config, from the run's resolved files, else the inputs."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.plan.memory import estimate_file
    from dstrain.recipe_file import load_recipe

    for row in rows:
        run = out / row.config
        try:
            files = RunDir(run)
            if files.recipe.is_file() and files.ds_config.is_file() and row.world_size:
                recipe_path, ds_path, world = files.recipe, files.ds_config, row.world_size
                recipe = load_recipe(recipe_path)
            elif recipe_file and row.config in sources and nproc:
                recipe_path, ds_path, world = Path(recipe_file), Path(sources[row.config]), nproc
                recipe = load_recipe_and_source(recipe_file, [*overrides, *row.config.split("+")[1:]])[0]
            else:
                continue
            from deepspeed.accelerator import get_accelerator

            fused = get_accelerator().device_name() == "cuda"  # the runs' devices: torch's fused RMSNorm or not
            row.est_mem_gib = estimate_file(recipe, ds_path, 1, world, fused_norms=fused).peak() / GIB
        except DstrainError:
            continue  # an invalid config: its row already says why


def build_report(out: Path, rows: list[Row], title: str, context: list[str]) -> None:
    ok = [r for r in rows if r.ok and r.final_loss is not None]
    base = ok[0] if ok and rows[0].ok else None
    for row in rows:
        if base is not None and base.final_loss is not None and row.final_loss is not None:
            row.loss_diff = row.final_loss - base.final_loss
    plots = ["loss.png", "throughput.png", "memory.png"]
    plot_losses(rows, out / plots[0])
    plot_throughput(rows, out / plots[1])
    plot_memory(rows, out / plots[2])
    if any(row.mix for row in rows):
        plots.append("mix.png")
        plot_mix(rows, out / plots[-1])
    write_csv(rows, out / "results.csv")
    baseline = f"`{base.config}`" if base else "none (the first config did not complete)"
    notes = [
        *context,
        "",
        THROUGHPUT_NOTE,
        "Peak memory is rank 0's `mem_peak_bytes` (the device allocator's peak; process RSS on a CPU); the estimate is "
        "`dstrain estimate`'s device peak (model states, activations, buffers) for the same ranks.",
        f"Δ loss is the final training loss minus that of the first config, {baseline}; equivalent strategies "
        "(same precision and optimizer) agree to about 1e-6 relative. Full logs: `<config>/launcher.log`.",
    ]
    write_markdown(rows, out / "report.md", title, notes, plots)


# --- the command ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="recipe YAML, the same for every config")
    parser.add_argument(
        "--deepspeed_configs",
        "--deepspeed-configs",
        nargs="+",
        default=[],
        metavar="CONFIG",
        help="ds_configs to compare, the first is the loss baseline (with --collect: the row order)",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks per run (default: every local device)")
    parser.add_argument("--steps", type=int, default=None, help="train.steps for every run (default: the recipe's)")
    parser.add_argument("--out", type=Path, help="report folder; each config runs in OUT/<config stem>/")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="report on the run folders in DIR; run nothing")
    parser.add_argument(
        "--plan", type=int, default=None, metavar="K", help="run the K fastest layouts dstrain plan predicts here"
    )
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides for every run, e.g. optim.lr=1e-3")


def main(args: argparse.Namespace) -> int:
    entries, swallowed = split_entries(args.deepspeed_configs)
    overrides = [*args.overrides, *swallowed]
    sources = {stem: config for stem, config, _ in entries}
    if args.collect:
        out = args.collect
        if not out.is_dir():
            raise DstrainError(f"--collect {out}: no such folder")
        found = sorted(p.name for p in out.iterdir() if p.is_dir() and (holds_a_run(p) or find_log(p)))
        names = list(sources) or found
        if not names:
            raise DstrainError(f"--collect {out}: no run folders (with metrics.jsonl, summary.json or a log) in it")
        rows = [read_run(out / name, sources.get(name)) for name in names]
        nproc = args.nproc
        context = [f"Collected from the run folders in `{out}`."]
    else:
        if args.plan is not None and (entries or args.plan < 1):
            raise DstrainError("--plan K: K >= 1 planned layouts take the place of --deepspeed_configs; pass one")
        if not args.recipe or not (entries or args.plan) or not args.out:
            raise DstrainError("dstrain compare needs --recipe, --deepspeed_configs and --out (or --collect DIR)")
        from deepspeed.accelerator import get_accelerator

        from dstrain.checkpoint.model_source import load_recipe_and_source

        check_counts(args.nproc, args.steps)
        overrides = run_overrides(overrides, args.steps)
        recipe = load_recipe_and_source(args.recipe, overrides)[0]  # a bad recipe or override stops here
        nproc = given(args.nproc, get_accelerator().device_count())
        out = args.out
        if args.plan:
            from dstrain.commands.compare_plan import write_planned

            with naming_files(recipe=args.recipe):
                configs, predicted = write_planned(recipe, nproc, args.plan, out)
            entries = [(Path(c).stem, c, []) for c in configs]
            sources = {stem: config for stem, config, _ in entries}
        check_fresh(out, entries)
        check_configs(args.recipe, entries, overrides, nproc)
        if args.plan:
            run_interleaved(args.recipe, entries, out, nproc, overrides, recipe.total_steps)
        else:
            run_all(args.recipe, entries, out, nproc, overrides)
        rows = [read_run(out / stem, config) for stem, config, _ in entries]
        context = [
            f"Recipe `{args.recipe}` (`{recipe.name}`: global batch {recipe.train.global_batch} × "
            f"{recipe.data.seq_len} tokens, {recipe.total_steps} steps) on {nproc} ranks per config, "
            f"{f'taking turns in {PLAN_ROUNDS} rounds' if args.plan else 'one config after another'}. "
            f"Overrides: `{' '.join(overrides)}`."
        ]
        if args.plan:
            from dstrain.commands.compare_plan import prediction_lines

            tokens = recipe.train.global_batch * recipe.data.seq_len
            table = prediction_lines(out, predicted, tokens)
            context += ["", *table]
            print("\n".join(table))
    add_estimates(rows, out, args.recipe, overrides, nproc, sources)
    build_report(out, rows, f"dstrain compare: {len(rows)} configs", context)
    completed = sum(r.ok for r in rows)
    print(f"{out / 'report.md'}: {completed} of {len(rows)} configs completed; results.csv and plots beside it")
    return 0 if all(r.ok for r in rows) else 1
