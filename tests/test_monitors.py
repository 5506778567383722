"""The dashboards: W&B, TensorBoard and CSV written by dstrain from metrics.jsonl's records, read back with the
clients' own readers (tests/monitor_readers.py), offline (WANDB_MODE=offline); one W&B run across a rollback and
a resume, no step shown twice."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import wandb
import yaml
from monitor_readers import csv_scalars, tensorboard_scalars, tensorboard_texts, wandb_runs

from dstrain.errors import DISK_FULL_EXIT, DiskFull, DstrainError, naming_files
from dstrain.metrics import MetricsLog
from dstrain.metrics_records import drop_records_after, read_events, read_records
from dstrain.monitors.settings import check_monitors, monitor_settings
from dstrain.run_dir import RunDir
from dstrain.train.run_folder import move_previous_run

from ranks import run_ranks
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
    with (
        pytest.raises(
            DstrainError, match=r"^d.json: wandb is enabled but wandb is not installed; pip install wandb==0.31.0$"
        ),
        naming_files(ds_config="d.json"),  # as preflight names the ds_config
    ):
        check_monitors({"wandb": {"enabled": True}}, tmp_path, {})
    with pytest.raises(DstrainError, match=r"^WANDB_PROJECT enables W&B but wandb is not installed"):
        check_monitors({}, tmp_path, {"WANDB_PROJECT": "p"})
    monkeypatch.setattr(importlib.util, "find_spec", real)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(DstrainError, match=rf"^WANDB_DIR={blocker}/wandb is not a writable folder; W&B \(offline\)"):
        check_monitors(
            {"wandb": {"enabled": True}},
            tmp_path,
            {"WANDB_DIR": str(blocker / "wandb"), "WANDB_MODE": "offline"},
        )
    with pytest.raises(DstrainError, match=r"^WANDB_MODE=offlne is not a W&B mode"):
        check_monitors({}, tmp_path, {"WANDB_MODE": "offlne"})
    no_key = {"NETRC": str(tmp_path / "no-netrc")}
    with pytest.raises(DstrainError, match=r"^W&B is online \(WANDB_MODE\) but finds no API key"):
        check_monitors({"wandb": {"enabled": True}}, tmp_path, no_key)
    check_monitors({"wandb": {"enabled": True}}, tmp_path, {**no_key, "WANDB_API_KEY": "k" * 40})
    offline = {"WANDB_DIR": str(tmp_path / "new" / "wandb"), "WANDB_MODE": "offline"}
    check_monitors(MONITORS, tmp_path, offline)  # a WANDB_DIR to be created is fine


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
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe_file, config_file = small_recipe(tmp_path, corpus), ds_config(tmp_path, "zero1", **MONITORS)
    recipe = load_recipe(str(recipe_file), [f"run_dir={tmp_path / 'run'}"])
    strategy = resolve(recipe, str(recipe_file), load_ds_config(str(config_file)), str(config_file), 2)
    assert strategy.resolved_ds_config["wandb"] == MONITORS["wandb"]
    assert strategy.resolved_ds_config["tensorboard"] == {
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
    _write_run_files(files)
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
    drop_records_after(files.metrics, 6)  # run_folder.claim_run_dir, resuming from global_step6
    log = MetricsLog(files, True, 10)
    log.write({"step": 6, "event": "resume", "tag": "global_step6", "changed": {"optim.lr": [0.001, 0.0005]}})
    for step in range(7, 11):
        log.write(record(step, 2))
    log.write({"step": 10, "split": "valid", "loss": 10.05, "ppl": 9.0})
    log.close()
    wandb.teardown()  # W&B's service writes the .wandb file's last records as it shuts down (at exit in a run)

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

    move_previous_run(files)  # what `--resume none` (or a start without a checkpoint) does: a new W&B run
    _write_run_files(files)  # run_folder.claim_run_dir writes them again
    log = MetricsLog(files, True, 10)
    log.write(record(1, 3))
    log.stopped(1, DiskFull("checkpoint global_step1 did not fit"), DISK_FULL_EXIT)  # as run.train does
    wandb.teardown()
    (fresh,) = wandb_runs(files.root / "wandb")
    assert fresh["id"] != sessions[0]["id"] and [row["_step"] for row in fresh["history"]] == [1]
    assert fresh["alerts"] == [
        ("tiny: disk_full at step 1", "disk_full at step 1: checkpoint global_step1 did not fit")
    ]
    assert fresh["exit_code"] == DISK_FULL_EXIT and sessions[0]["exit_code"] == 0
    assert read_events(files.metrics)[-1]["event"] == "disk_full"
    assert by_step(tensorboard_scalars(files.root / "tensorboard" / "tiny")["train/loss"]) == pytest.approx({1: 1.3})


def _write_run_files(files: RunDir) -> None:
    files.recipe.write_text(yaml.safe_dump({"name": "tiny", "seed": 1}))
    files.ds_config.write_text(json.dumps(_resolved(files)))


def _resolved(files: RunDir) -> dict:
    return {
        "tensorboard": {"enabled": True, "output_path": str(files.root / "tensorboard"), "job_name": "tiny"},
        "csv_monitor": {"enabled": True, "output_path": str(files.root / "csv"), "job_name": "tiny"},
        "wandb": {"enabled": True, "project": "dstrain-tests"},
    }


# --- a real run, 2 ranks, every monitor on: a spike rolled back, a stop, a resume, a fresh start ---------------------

GUARD = ("train.spike_guard.enabled=true", "train.spike_guard.window=3")
POISON = (48, 56)  # global batch 6 (8 samples), read by step 7: a spike, rolled back to global_step6


def poisoned_then_stopped(argv: list[str], stop_after: int) -> int:
    """Rank target: train with samples POISON's loss x 10 (a spike at step 7), rank 0 asking to stop after step
    ``stop_after``."""
    from dstrain.train.run import main
    from dstrain.train.step.step_hooks import StepHooks

    class Hooks(StepHooks):
        def train_batch(self, samples, batch):
            return {**batch, "poisoned": any(POISON[0] <= i < POISON[1] for i in samples)}

        def forward(self, step, batch, forward):
            loss = forward(batch)
            return loss * 10.0 if batch.get("poisoned") else loss

        def stepped(self, taken: int) -> None:
            if taken == stop_after and os.environ["RANK"] == "0":
                os.kill(os.getpid(), signal.SIGUSR1)

    return main(argv, Hooks())


@pytest.fixture(scope="module")
def monitored(tmp_path_factory, corpus):
    """Steps 1-8 (a spike at 7 rolled back to 6, a stop after 8), then the same command again (resumes to 10)."""
    folder = tmp_path_factory.mktemp("monitored")
    recipe = small_recipe(folder, corpus, train={"checkpoint_interval": 2, "eval_interval": 2})
    run = folder / "run"
    argv = train_argv(recipe, ds_config(folder, "zero1", **MONITORS), run, *GUARD, "train.eval_samples=8")
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_RUN_ID", "WANDB_DIR"):
            env.delenv(name, raising=False)
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        assert run_ranks(2, poisoned_then_stopped, argv, 8) == [0, 0]
        assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
        assert run_ranks(2, poisoned_then_stopped, argv, 0) == [0, 0]
    return run


@pytest.mark.distributed
def test_every_number_reaches_each_monitor_once_at_its_step(monitored):
    run = monitored
    records = read_records(run / "metrics.jsonl")
    train = {r["step"]: r["loss"] for r in records if "split" not in r}
    valid = {r["step"]: r["loss"] for r in records if r.get("split") == "valid"}
    assert list(train) == list(range(1, 11)) and list(valid) == [2, 4, 6, 8, 10]
    assert [(e["event"], e["step"]) for e in read_events(run / "metrics.jsonl")] == [("spike", 6), ("resume", 8)]
    tb = tensorboard_scalars(run / "tensorboard" / "small")
    assert by_step(tb["train/loss"]) == pytest.approx(train, rel=1e-6)  # float32 in event files
    assert by_step(tb["eval/loss"]) == pytest.approx(valid, rel=1e-6)
    assert set(by_step(tb["train/lr"])) == set(train) and "train/mem_peak_bytes" in tb
    texts = tensorboard_texts(run / "tensorboard" / "small")
    assert [s for s, _ in texts["events/spike"]] == [6] and [s for s, _ in texts["events/resume"]] == [8]
    assert "config" in texts
    csvs = csv_scalars(run / "csv" / "small")
    assert by_step(csvs["train_loss"]) == train and by_step(csvs["eval_loss"]) == valid
    sessions = wandb_runs(run / "wandb")
    assert (
        len(sessions) == 2
        and sessions[0]["id"] == sessions[1]["id"] == json.loads((run / "wandb_run.json").read_text())["id"]
    )
    # The spike was rolled back before step 7 was logged: W&B holds exactly metrics.jsonl's numbers.
    assert wandb_history(sessions, "train/loss") == train
    assert wandb_history(sessions, "eval/loss") == valid
    assert set(wandb_history(sessions, "train/tokens_per_s")) == set(train)
    alerts = [title for s in sessions for title, _ in s["alerts"]]
    assert alerts == ["small: spike at step 6", "small: resume at step 8"]
    assert sessions[0]["config"]["recipe"]["train"]["steps"] == 10
    assert sessions[0]["config"]["ds_config"]["zero_optimization"]["stage"] == 1


KILLED_JOB = """
import os, sys
from pathlib import Path
from dstrain.metrics import MetricsLog
from dstrain.run_dir import RunDir

log = MetricsLog(RunDir(Path(sys.argv[1])), True, 6)
for step in range(1, 6):
    log.write({"step": step, "loss": step + 0.1})
os._exit(9)  # a job killed hard: no close, W&B's service dies with it
"""


def test_a_job_killed_hard_leaves_nothing_missing_from_wandb(offline):
    """A killed job's W&B service dies before writing (all) its records; the next job, in the same W&B run, sends
    what the run folder kept (steps 1-2, before the checkpoint) and what it trains again (3-6): every step, once."""
    files = RunDir(offline / "run")
    files.root.mkdir()
    _write_run_files(files)
    killed = subprocess.run([sys.executable, "-c", KILLED_JOB, str(files.root)], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr[-2000:]
    assert json.loads(files.wandb_run.read_text())["logged_through"] == -1  # nothing W&B surely holds
    drop_records_after(files.metrics, 2)  # run_folder.claim_run_dir, resuming from global_step2
    log = MetricsLog(files, True, 6)
    log.write({"step": 2, "event": "resume", "tag": "global_step2", "changed": {}})
    for step in range(3, 7):
        log.write({"step": step, "loss": step + 0.2})
    log.close()
    wandb.teardown()
    want = {1: 1.1, 2: 2.1, 3: 3.2, 4: 4.2, 5: 5.2, 6: 6.2}
    assert {r["step"]: r["loss"] for r in read_records(files.metrics)} == want
    sessions = wandb_runs(files.root / "wandb")
    (finished,) = [s for s in sessions if s["exit_code"] == 0]  # what the killed job's file holds depends on timing
    assert {s["id"] for s in sessions if s["id"]} == {finished["id"]}
    assert wandb_history([finished], "train/loss") == want
    assert by_step(csv_scalars(files.root / "csv" / "tiny")["train_loss"]) == want
    assert by_step(tensorboard_scalars(files.root / "tensorboard" / "tiny")["train/loss"]) == pytest.approx(want)
