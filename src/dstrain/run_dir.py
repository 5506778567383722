"""The run folder: every file a run leaves in its ``run_dir``, and the names of its checkpoints, in one place.

recipe.yaml, ds_config.json   what the run resolved (the recipe, the complete ds_config); recipe.yaml also records
                              the launch: its working directory and where the recipe's paths resolved there
tokenizer/                    the tokenizer of the run's data, copied at its start: export, generate and eval read it
metrics.jsonl, summary.json   one record per logged step / evaluation / event; the run's outcome
checkpoints/global_step<N>/   DeepSpeed's checkpoint of step N, and `latest` naming the newest
logs/rank<r>.log, loss.png    each rank's full output; train and valid loss with the learning rate
tasks.png                     the train.tasks' accuracies at each evaluation (runs with train.tasks)
hf/<tag>/                      published checkpoints as Hugging Face folders (train.export_every)
hang/rank<r>.txt              every thread's stack of each rank when the hang watchdog fired, the stuck ranks named
elastic/                      slurm/train.sbatch's relaunches after a failed step: hosts, events
(dstrain.train.process.elastic)
tensorboard/, csv/            the monitors' files, when the ds_config enables them (dstrain.monitors)
wandb_run.json, wandb/        the W&B run this run logs to (its id: a resumed run continues it), W&B's own files
previous/<UTC time>/          an earlier run's files, moved aside by `--resume none`
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

TAG = re.compile(r"^global_step(\d+)$")
LATEST = "latest"  # in a checkpoints folder: the newest published tag's name (DeepSpeed's convention)


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int:
    """The step a checkpoint tag was saved at."""
    match = TAG.match(tag)
    if match is None:
        raise ValueError(f"{tag!r} is not a checkpoint tag (global_step<N>)")
    return int(match.group(1))


@dataclass(frozen=True)
class RunDir:
    root: Path

    # What a run writes (the monitors: tensorboard/, csv/, wandb_run.json and W&B's wandb/), and so what
    # `--resume none` moves into previous/ (a fresh start is a new W&B run).
    # The logs of the launch itself (compare's launcher.log, the Slurm job's link) stay.
    WRITTEN = (
        "checkpoints",
        "metrics.jsonl",
        "summary.json",
        "recipe.yaml",
        "ds_config.json",
        "tokenizer",
        "logs",
        "loss.png",
        "tasks.png",
        "tensorboard",
        "csv",
        "wandb_run.json",
        "wandb",
        "hang",
        "hf",
    )
    # What may be in a run folder besides: a metrics rewrite in progress, what launchers put there first
    # (slurm/train.sbatch its hostfile, and elastic/: its relaunches, dstrain.train.process.elastic), earlier runs.
    ALLOWED = (*WRITTEN, "metrics.jsonl.tmp", "hostfile", "elastic", "previous")

    @classmethod
    def find(cls, path: str | os.PathLike) -> RunDir | None:
        """The run folder at ``path``, or None where ``path`` is no dstrain run (it has no recipe.yaml)."""
        run = cls(Path(path))
        return run if run.recipe.is_file() else None

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def ds_config(self) -> Path:
        return self.root / "ds_config.json"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST

    @property
    def records(self) -> tuple[Path, ...]:
        """What any run leaves, even one that failed at its start: one of them there, a run was here."""
        return self.metrics, self.summary, self.ds_config

    @property
    def wandb_run(self) -> Path:
        """The W&B run's id and the last step sent to it (dstrain.monitors.wandb_run)."""
        return self.root / "wandb_run.json"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def tasks_plot(self) -> Path:
        return self.root / "tasks.png"

    @property
    def hang(self) -> Path:
        return self.root / "hang"

    @property
    def previous(self) -> Path:
        return self.root / "previous"

    def hf_export(self, tag: str) -> Path:
        """Checkpoint ``tag`` as a Hugging Face folder (train.export_every)."""
        return self.root / "hf" / tag

    def log(self, rank: int) -> Path:
        return self.root / "logs" / f"rank{rank}.log"

    def written(self) -> list[Path]:
        """The files and folders of a run that are there now."""
        return [self.root / name for name in self.WRITTEN if (self.root / name).exists()]


# run_dir/recipe.yaml records the launch beside the recipe: the working directory and where each path the recipe
# names resolved to there, {"cwd": "/abs", "paths": {"data.sources[0].path": "/abs/data/x", ...}}. Relative paths
# keep meaning "relative to where you launch"; the record lets `dstrain eval` of a run find its data from anywhere.
# load_recipe drops it, so a run's recipe.yaml launches again as it is.
LAUNCH_KEY = "launch"


@dataclass(frozen=True)
class LaunchRecord:
    """The LAUNCH_KEY section of a run's recipe.yaml."""

    cwd: str  # the working directory of the launch, absolute
    paths: dict[str, str]  # {dotted recipe key: absolute path} of each recipe path that existed there

    @classmethod
    def read(cls, recipe_file: str | Path) -> LaunchRecord:
        """The record a run's recipe.yaml carries; a one-line DstrainError where it has none (a launch writes it
        with the recipe, so a file without it is not a run's)."""
        from dstrain.errors import DstrainError

        try:
            raw = yaml.safe_load(Path(recipe_file).read_text())
            launch = raw[LAUNCH_KEY]
            return cls(str(launch["cwd"]), {str(k): str(v) for k, v in launch["paths"].items()})
        except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError) as e:
            raise DstrainError(
                f"{recipe_file}: no readable `{LAUNCH_KEY}` record ({type(e).__name__}: {e}), so it is not the "
                "recipe.yaml of a dstrain run; name the run folder `dstrain train` wrote"
            ) from None
