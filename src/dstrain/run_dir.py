"""The run folder: every file a run leaves in its ``run_dir``, and the names of its checkpoints, in one place.

recipe.yaml, ds_config.json   what the run resolved (the recipe, the complete ds_config); recipe.yaml also records
                              the launch: its working directory and where the recipe's paths resolved there
tokenizer/                    the tokenizer of the run's data, copied at its start: export, generate and eval read it
metrics.jsonl, summary.json   one record per logged step / evaluation / event; the run's outcome
checkpoints/global_step<N>/   DeepSpeed's checkpoint of step N, and `latest` naming the newest
logs/rank<r>.log, loss.png    each rank's full output; train and valid loss with the learning rate
tasks.png                     the train.tasks' accuracies at each evaluation (runs with train.tasks)
hang/rank<r>.txt              every thread's stack of each rank when the hang watchdog fired, the stuck ranks named
previous/<UTC time>/          an earlier run's files, moved aside by `--resume none`
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TAG = re.compile(r"^global_step(\d+)$")


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

    # What a run writes (DeepSpeed's monitors: tensorboard/, csv/), and so what `--resume none` moves into previous/.
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
        "hang",
    )
    # What may be in a run folder besides: a metrics rewrite in progress, W&B's folder, what launchers put there
    # first (slurm/train.sbatch its hostfile), earlier runs.
    ALLOWED = (*WRITTEN, "metrics.jsonl.tmp", "wandb", "hostfile", "previous")

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
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def tasks_plot(self) -> Path:
        return self.root / "tasks.png"

    @property
    def previous(self) -> Path:
        return self.root / "previous"

    def log(self, rank: int) -> Path:
        return self.root / "logs" / f"rank{rank}.log"

    def written(self) -> list[Path]:
        """The files and folders of a run that are there now."""
        return [self.root / name for name in self.WRITTEN if (self.root / name).exists()]
