"""The dashboards: W&B, TensorBoard and CSV written by dstrain from metrics.jsonl's records, read back with the
clients' own readers (tests/monitor_readers.py), offline (WANDB_MODE=offline); one W&B run across a rollback and
a resume, no step shown twice."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest
import yaml
from monitor_readers import csv_scalars, tensorboard_scalars, tensorboard_texts, wandb_runs

from dstrain.errors import DstrainError
from dstrain.metrics import MetricsLog, drop_records_after, read_events, read_records
from dstrain.monitors.settings import check_monitors, monitor_settings
from dstrain.run_dir import RunDir

from train_helpers import ds_config, small_recipe, train_argv

MONITORS = {
    "tensorboard": {"enabled": True},
    "csv_monitor": {"enabled": True},
    "wandb": {"enabled": True, "project": "dstrain-tests"},
}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, its files in this test's folder, no W&B variable of the machine's user."""
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_RUN_ID", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def by_step(pairs) -> dict[int, float]:
    steps = [step for step, _ in pairs]
    assert len(steps) == len(set(steps)), f"a step shown twice: {steps}"
    return dict(pairs)


def wandb_history(sessions: list[dict], key: str) -> dict[int, float]:
    """{step: value} of ``key`` over every session of one W&B run, each step once."""
    return by_step([(row["_step"], row[key]) for s in sessions for row in s["history"] if key in row])


# --- settings and refusals ----------------------------------------------------------------------------------------


def test_wandb_settings_come_from_the_block_then_wandb_environment(tmp_path):
    env = {"WANDB_PROJECT": "env-p", "WANDB_ENTITY": "env-team", "WANDB_RUN_GROUP": "env-g", "WANDB_MODE": "dryrun"}
    block = monitor_settings({"wandb": {"enabled": True, "project": "p", "team": "t"}}, tmp_path, env).wandb
    assert block is not None and (block.project, block.entity, block.group) == ("p", "t", "env-g")
    assert block.mode == "offline" and block.dir == tmp_path  # W&B's files in the run folder without WANDB_DIR
    only_env = monitor_settings({}, tmp_path, {**env, "WANDB_DIR": str(tmp_path / "w")}).wandb
    assert only_env is not None and (only_env.project, only_env.entity) == ("env-p", "env-team")
    assert only_env.dir == tmp_path / "w"
    assert monitor_settings({"wandb": {"enabled": False}}, tmp_path, env).wandb is None  # the block says no
    assert monitor_settings({}, tmp_path, {**env, "WANDB_MODE": "disabled"}).wandb is None
    assert monitor_settings({}, tmp_path, {}).wandb is None
    tb = monitor_settings({"tensorboard": {"enabled": True, "output_path": "/x", "job_name": "j"}}, tmp_path, {})
    assert str(tb.tensorboard) == "/x/j" and tb.csv is None


def test_missing_monitor_pieces_are_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        DstrainError, match=r"^d.json: wandb is enabled but wandb is not installed; pip install wandb==0.31.0$"
    ):
        check_monitors({"wandb": {"enabled": True}}, "d.json", tmp_path, {})
    with pytest.raises(DstrainError, match=r"^WANDB_PROJECT enables W&B but wandb is not installed"):
        check_monitors({}, "d.json", tmp_path, {"WANDB_PROJECT": "p"})
    monkeypatch.setattr(importlib.util, "find_spec", real)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(DstrainError, match=rf"^WANDB_DIR={blocker}/wandb is not a writable folder; W&B \(offline\)"):
        check_monitors(
            {"wandb": {"enabled": True}},
            "d.json",
            tmp_path,
            {"WANDB_DIR": str(blocker / "wandb"), "WANDB_MODE": "offline"},
        )
    with pytest.raises(DstrainError, match=r"^WANDB_MODE=offlne is not a W&B mode"):
        check_monitors({}, "d.json", tmp_path, {"WANDB_MODE": "offlne"})
    check_monitors(MONITORS, "d.json", tmp_path, {"WANDB_DIR": str(tmp_path / "new" / "wandb")})  # created later


@pytest.mark.parametrize(
    "block, fragments",
    [
        ({"wandb": {"enabled": True, "job_name": "x"}}, ['unknown key "wandb.job_name"']),
        ({"wandb": {"enabled": True, "projet": "x"}}, ['unknown key "wandb.projet"', '"wandb.project"']),
        (
            {"csv_monitor": {"enabled": True, "outputpath": "x"}},
            ['"csv_monitor.outputpath"', '"csv_monitor.output_path"'],
        ),
    ],
)
def test_unknown_monitor_keys_are_refused_before_any_work(block, fragments, tmp_path, corpus, capsys, monkeypatch):
    from dstrain.train.run import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    run = tmp_path / "run"
    argv = train_argv(small_recipe(tmp_path, corpus), ds_config(tmp_path, "zero1", **block), run)
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dstrain: error: ") and all(f in line for f in fragments), line
    assert not run.exists()


def test_deepspeeds_own_wandb_block_resolves_as_written(tmp_path, corpus):
    """The block of DeepSpeed's documentation is accepted (dstrain once filled a job_name into it, which DeepSpeed's
    schema refuses) and keeps what the user wrote; TensorBoard's and CSV's folders go into the run folder."""
    from dstrain.config import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe_file, config_file = small_recipe(tmp_path, corpus), ds_config(tmp_path, "zero1", **MONITORS)
    recipe = load_recipe(str(recipe_file), [f"run_dir={tmp_path / 'run'}"])
    strategy = resolve(recipe, str(recipe_file), load_ds_config(str(config_file)), str(config_file), 2)
    assert strategy.ds_config["wandb"] == MONITORS["wandb"]
    assert strategy.ds_config["tensorboard"] == {
        "enabled": True,
        "output_path": str(tmp_path / "run" / "tensorboard"),
        "job_name": "small",
    }


# --- the monitors as sinks of MetricsLog, in one process --------------------------------------------------------


def record(step: int, attempt: int) -> dict:
    return {"step": step, "loss": step + attempt / 10, "lr": 1e-3, "grad_norm": None, "mix_web": 0.5}


def test_monitors_follow_a_rollback_and_a_resume_after_a_kill(offline):
    """Session 1 logs steps 1-6, rolls back to step 4 (a spike) and logs 5-8 again; it is killed, the checkpoint
    of step 6 resumes in session 2, which logs 7-10 again (the same values: a resumed run continues exactly).
    TensorBoard and CSV show what metrics.jsonl holds, each step once; W&B, which refuses to rewrite a step, keeps
    the values it was sent first, each step once, in one run."""
    files = RunDir(offline / "run")
    files.root.mkdir()
    files.recipe.write_text(yaml.safe_dump({"name": "tiny", "seed": 1}))
    files.ds_config.write_text(json.dumps(_resolved(files)))
    log = MetricsLog(files, True, 10)
    for step in range(1, 7):
        log.write(record(step, 1))
        if step % 2 == 0:
            log.write({"step": step, "split": "valid", "loss": step + 0.05, "ppl": 9.0})
    log.drop_after(4)
    log.write(
        {
            "step": 4,
            "event": "spike",
            "spike_step": 6,
            "metric": "loss",
            "value": 9.0,
            "threshold": 3.0,
            "median": 1.5,
            "rolled_back_to": "global_step4",
            "skipped_samples": [32, 48],
        }
    )
    for step in range(5, 9):
        log.write(record(step, 2))
    log.close()  # not what a killed job does; what W&B received is the point
    drop_records_after(files.metrics, 6)  # run.claim_run_dir, resuming from global_step6
    log = MetricsLog(files, True, 10)
    log.write({"step": 6, "event": "resume", "tag": "global_step6", "changed": {"optim.lr": [0.001, 0.0005]}})
    for step in range(7, 11):
        log.write(record(step, 2))
    log.write({"step": 10, "split": "valid", "loss": 10.05, "ppl": 9.0})
    log.close()

    train = {r["step"]: r["loss"] for r in read_records(files.metrics) if "split" not in r}
    assert train == {s: s + (0.1 if s <= 4 else 0.2) for s in range(1, 11)}
    tb = tensorboard_scalars(files.root / "tensorboard" / "tiny")
    assert by_step(tb["train/loss"]) == pytest.approx(train, rel=1e-7)  # float32 in event files
    assert set(by_step(tb["eval/loss"])) == {2, 4, 10} and "train/grad_norm" not in tb
    assert by_step(csv_scalars(files.root / "csv" / "tiny")["train_loss"]) == train
    sessions = wandb_runs(files.root / "wandb")  # W&B's files in the run folder (no WANDB_DIR)
    assert len(sessions) == 2 and sessions[0]["id"] == sessions[1]["id"]
    assert json.loads(files.wandb_run.read_text()) == {"id": sessions[0]["id"], "logged_through": 10}
    sent_first = {s: s + (0.1 if s <= 6 else 0.2) for s in range(1, 11)}  # 5 and 6: before the rollback
    assert wandb_history(sessions, "train/loss") == sent_first
    assert wandb_history(sessions, "eval/loss") == {2: 2.05, 4: 4.05, 6: 6.05, 10: 10.05}
    assert wandb_history(sessions, "train/mix_web") == dict.fromkeys(range(1, 11), 0.5)
    titles = [title for s in sessions for title, _ in s["alerts"]]
    assert titles == ["tiny: spike at step 4", "tiny: resume at step 6"]
    assert "optim.lr 0.001 → 0.0005" in sessions[1]["alerts"][0][1]
    assert sessions[0]["config"]["recipe"]["name"] == "tiny" and "wandb" in sessions[0]["config"]["ds_config"]
    texts = tensorboard_texts(files.root / "tensorboard" / "tiny")
    assert [step for step, _ in texts["events/spike"]] == [4] and [s for s, _ in texts["events/resume"]] == [6]
    with (files.root / "csv" / "tiny" / "events.csv").open() as f:
        assert [row[:2] for row in csv.reader(f)] == [["step", "event"], ["4", "spike"], ["6", "resume"]]
    assert [e["event"] for e in read_events(files.metrics)] == ["spike", "resume"]


def _resolved(files: RunDir) -> dict:
    return {
        "tensorboard": {"enabled": True, "output_path": str(files.root / "tensorboard"), "job_name": "tiny"},
        "csv_monitor": {"enabled": True, "output_path": str(files.root / "csv"), "job_name": "tiny"},
        "wandb": {"enabled": True, "project": "dstrain-tests"},
    }
