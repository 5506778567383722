"""Shared pieces of the trainer tests: a small recipe on the real corpus, and rank targets."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def small_recipe(folder: Path, corpus: Path, name: str = "small", **sections) -> Path:
    """A 2-block Llama-style model on the prepared stdlib corpus: 10 steps of 8 x 32 tokens."""
    recipe = {
        "name": name,
        "seed": 7,
        "model": {"flavour": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64},
        "data": {"sources": [{"path": str(corpus)}], "seq_len": 32, "valid_fraction": 0.05},
        "train": {"global_batch": 8, "steps": 10, "log_interval": 1, "eval_samples": 32, "keep_last": 2},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 2},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def ds_config(folder: Path, base: str, **changes) -> Path:
    """A shipped ds_config with top-level changes (e.g. a micro-batch), written next to the test's files."""
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    config.update(changes)
    path = folder / f"{base}-{'-'.join(f'{k}{v}' for k, v in changes.items()) or 'as-shipped'}.json"
    path.write_text(json.dumps(config))
    return path


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "split" not in r]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_each(runs: list[list[str]]) -> list[int]:
    """Rank target: run dstrain.train once per argv, one after another, in this process group."""
    from dstrain.train.run import main

    return [main(argv) for argv in runs]


def train_and_signal_at(argv: list[str], step: int, signum: int = signal.SIGUSR1) -> int:
    """Rank target: train, with rank 0 sending itself ``signum`` right after optimizer step ``step``."""
    from dstrain.train.loop import Trainer
    from dstrain.train.run import main

    original = Trainer.train_step

    def train_step(self, batches):
        loss = original(self, batches)
        if self.progress.step + 1 == step and int(os.environ["RANK"]) == 0:
            os.kill(os.getpid(), signum)
        return loss

    Trainer.train_step = train_step
    return main(argv)
