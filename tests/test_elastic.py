"""dstrain.train.process.elastic: what slurm/train.sbatch does after a failed step, decided without Slurm
(tests/test_slurm.py
runs the same decisions on the emulated cluster)."""

from __future__ import annotations

import json

import pytest

from dstrain.errors import DstrainError
from dstrain.train.process import elastic
from dstrain.train.process.elastic import ElasticConfig, decide, start


def accumulation(world: int) -> int:
    """The small recipe's arithmetic: a global batch of 8 at 2 samples per rank; 3 ranks cannot hold it."""
    if 8 % (2 * world):
        raise DstrainError(f"train.global_batch=8 is not a multiple of 2 x {world} ranks")
    return 8 // (2 * world)


@pytest.mark.parametrize(
    "config, nodes, message",
    [
        (ElasticConfig(spare_nodes=2), 2, "--spare-nodes=2 with 2 node(s) allocated leaves no node to train on"),
        (ElasticConfig(min_nodes=3), 2, "--min-nodes=3 but 2 node(s) train"),
        (ElasticConfig(spare_nodes=1, min_nodes=2), 2, "--min-nodes=2 but 1 node(s) train (2 allocated, 1 spare)"),
        (ElasticConfig(max_restarts=-1), 2, "--max-restarts=-1; use 0"),
    ],
)
def test_bad_options_are_one_line_before_any_work(config, nodes, message):
    with pytest.raises(DstrainError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        config.check(nodes)
    assert "\n" not in str(raised.value)


def test_a_lost_node_shrinks_the_world_and_the_accumulation_grows():
    state = start(ElasticConfig(), "7.0", ["n1", "n2", "n3", "n4"], gpus=1)
    two_lost = decide(state, ElasticConfig(), {"n3", "n4"}, [], accumulation)
    assert two_lost.kind == "shrink" and two_lost.details["world"] == 2 and two_lost.details["accumulation"] == 2
    assert "lost n3 (unreachable), n4 (unreachable); excluded" in two_lost.line
    assert "world 2, accumulation 2, restart 1 of 3" in two_lost.line


def test_a_world_that_cannot_hold_the_global_batch_requeues():
    state = start(ElasticConfig(), "7.0", ["n1", "n2", "n3", "n4"], gpus=1)
    decision = decide(state, ElasticConfig(), {"n4"}, [], accumulation)
    assert decision.action == "requeue"
    assert "3 rank(s) cannot hold the global batch" in decision.line and decision.line.endswith("requeue")


def test_a_spare_replaces_the_lost_node_and_the_world_is_unchanged():
    config = ElasticConfig(spare_nodes=1)
    state = start(config, "7.0", ["n1", "n2", "n3"], gpus=2)
    assert (state.hosts, state.spares, state.world) == (["n1", "n2"], ["n3"], 4)
    # The watchdog named rank 1, which runs on n1 (ranks 0-1 on n1, 2-3 on n2)
    decision = decide(state, config, set(), [1], accumulation)
    assert (decision.kind, decision.hosts, decision.details["world"]) == ("spare", ["n2", "n3"], 4)
    assert decision.details["lost"] == {"n1": "named by the hang watchdog"}


def test_no_node_lost_restarts_in_place_until_the_cap_then_requeues():
    config = ElasticConfig(max_restarts=1)
    state = start(config, "7.0", ["n1", "n2"], gpus=1)
    first = decide(state, config, set(), [], accumulation)
    assert (first.action, first.kind, first.hosts) == ("relaunch", "restart", ["n1", "n2"])
    state.restarts = 1
    second = decide(state, config, set(), [], accumulation)
    assert second.action == "requeue" and "restart cap reached (1 in this job)" in second.line


def test_fewer_nodes_than_the_minimum_requeue():
    config = ElasticConfig(min_nodes=2)
    state = start(config, "7.0", ["n1", "n2"], gpus=1)
    decision = decide(state, config, {"n2"}, [], accumulation)
    assert decision.action == "requeue" and "1 healthy node(s) left, fewer than --min-nodes=2" in decision.line


def test_the_next_command_keeps_the_state_and_leaves_the_event_for_the_next_launch(tmp_path, corpus, capsys):
    from train_helpers import ROOT, small_recipe

    recipe, ds = str(small_recipe(tmp_path, corpus)), str(ROOT / "ds_configs" / "zero0.json")
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--recipe", recipe, "--ds-config", ds]
    assert (
        elastic.main(["start", "--job", "7.0", "--gpus", "1", "--hosts", "n1,n2,n3", "--spare-nodes", "1", *common])
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1].split() == ["n1", "n2"]
    (run / "metrics.jsonl").write_text(json.dumps({"step": 12, "loss": 5.0}) + "\n")
    assert elastic.main(["next", "--unreachable", "n2", *common]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1].split() == ["relaunch", "n1", "n3"] and "spare n3 takes its place" in out.err
    config, state = elastic.load_state(run)
    assert (state.hosts, state.spares, state.excluded, state.restarts) == (["n1", "n3"], [], ["n2"], 1)
    pending = json.loads((run / "elastic" / "pending.json").read_text())
    assert pending["event"] == "spare" and pending["fault_step"] == 12 and pending["world"] == 2
    # a bad option: one line, exit 2, nothing launched
    assert elastic.main(["start", "--job", "7.1", "--gpus", "1", "--hosts", "n1", "--spare-nodes", "1", *common]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_relaunch_is_an_event_at_its_first_step_with_what_it_cost(tmp_path):
    """RestartEvent: the pending decision logged once (metrics.jsonl's path, so every dashboard's), under the step it
    resumed from, with the steps trained again and the seconds since the last step logged before the fault."""
    import time
    from types import SimpleNamespace

    from dstrain.monitors.records import describe
    from dstrain.train.features.restart_event import RestartEvent
    from dstrain.train.step.components import StepOutcome, Verdict

    (tmp_path / "elastic").mkdir()
    pending = {"event": "shrink", "fault_step": 14, "fault_time": time.time() - 30.0, "detail": "lost n2 (unreachable)"}
    (tmp_path / "elastic" / "pending.json").write_text(json.dumps(pending))
    records: list[dict] = []
    trainer = SimpleNamespace(
        files=SimpleNamespace(root=tmp_path), is_rank0=True, log=SimpleNamespace(write=records.append)
    )
    component = RestartEvent(trainer)
    for step in (11, 12):
        assert component.on_step_end(StepOutcome(step, 5.0, 1.0, False)) is Verdict.GO_ON
    (event,) = records
    assert (event["step"], event["first_step"], event["steps_lost"]) == (10, 11, 4)
    assert 30.0 <= event["time_lost_s"] < 60.0 and "fault_time" not in event
    assert describe(event).startswith("shrink at step 10: lost n2 (unreachable); 30 s and 4 step(s) lost")
    assert not (tmp_path / "elastic" / "pending.json").exists()
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    elastic.fold_into_summary(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["restarts"] == [event]
