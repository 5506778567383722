"""The component seam proven by two features that are each one module and one line in features.BUILDERS, the loop
unchanged by them: early stopping on the valid loss (train.early_stop) and an export of each published checkpoint
to a Hugging Face folder (train.export_every)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dstrain.config import EarlyStopConfig
from dstrain.train.features.early_stop import EarlyStop
from dstrain.train.step.components import Progress, Verdict

from ranks import run_ranks
from train_helpers import read_events, small_recipe, train, train_argv


class Log:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.lines: list[str] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def note(self, line: str) -> None:
        self.lines.append(line)


def evaluation(step: int, loss: float) -> list[dict]:
    return [{"step": step, "split": "valid/a", "loss": 9.0}, {"step": step, "split": "valid", "loss": loss}]


@pytest.mark.unit
def test_early_stop_counts_evaluations_without_an_improvement_of_the_valid_loss():
    run = SimpleNamespace(progress=Progress(), log=Log())
    stop = EarlyStop(EarlyStopConfig(patience=2, min_delta=0.1), run)
    verdicts = []
    for step, loss in enumerate([3.0, 2.5, 2.45, 2.3, 2.35, 2.5], start=1):
        run.progress.step = step
        verdicts.append(stop.on_eval_end(evaluation(step, loss)))
    # 2.45 is within min_delta of 2.5 (1 without), 2.3 improves (0), 2.35 and 2.5 do not (2 = patience): stop
    assert verdicts == [Verdict.GO_ON] * 5 + [Verdict.STOP]
    assert run.log.records == [{"step": 6, "event": "early_stop", "best_loss": 2.3, "loss": 2.5}]
    assert len(run.log.lines) == 1 and "train.early_stop.patience" in run.log.lines[0]
    resumed = EarlyStop(EarlyStopConfig(patience=2, min_delta=0.1), run)
    resumed.load_state_dict(stop.state_dict())  # the count goes on in a resumed run
    assert resumed.on_eval_end(evaluation(7, 2.31)) is Verdict.STOP


@pytest.mark.unit
def test_early_stop_needs_evaluations(tmp_path, corpus):
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe

    recipe = small_recipe(tmp_path, corpus, train={"early_stop": {"patience": 2}})
    with pytest.raises(DstrainError, match=r"train.early_stop.patience=2 counts evaluations.*set train.eval_interval"):
        load_recipe(recipe)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, corpus):
    """One rank, evaluating every step, a min_delta no loss beats: stops after the second evaluation (step 2) of 10,
    exporting every published checkpoint of an even step."""
    tmp = tmp_path_factory.mktemp("seam")
    recipe = small_recipe(tmp, corpus, train={"eval_interval": 1, "eval_samples": 8, "export_every": 2})
    run = tmp / "run"
    argv = train_argv(recipe, "zero1", run, "train.early_stop.patience=1", "train.early_stop.min_delta=100")
    assert run_ranks(1, train, argv) == [0]
    return run


@pytest.mark.distributed
def test_early_stop_ends_the_run_cleanly(stopped_run):
    summary = json.loads((stopped_run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["step"] == 2
    (event,) = [e for e in read_events(stopped_run) if e["event"] == "early_stop"]
    assert event["step"] == 2 and event["loss"] >= event["best_loss"] - 100
    assert (stopped_run / "checkpoints" / "global_step2").is_dir()  # the end's checkpoint, as a finished run's
    assert (stopped_run / "checkpoints" / "latest").read_text().strip() == "global_step2"


@pytest.mark.distributed
def test_each_published_checkpoint_of_export_every_is_the_export_of_its_tag(stopped_run, tmp_path):
    from dstrain.commands import cli

    folder = stopped_run / "hf" / "global_step2"
    (event,) = [e for e in read_events(stopped_run) if e["event"] == "hf_export"]
    assert event["tag"] == "global_step2" and Path(event["folder"]) == folder
    assert cli.main(["export", str(stopped_run), "--tag", "global_step2", "--out", str(tmp_path / "cli")]) == 0
    ours, theirs = load_file(folder / "model.safetensors"), load_file(tmp_path / "cli" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (folder / "config.json").read_text() == (tmp_path / "cli" / "config.json").read_text()
    assert (folder / "tokenizer.json").is_file()
