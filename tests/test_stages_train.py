"""A staged mixture in training (2 CPU ranks, fp32): resume across the stage boundary continues bit for bit, also on
another world size; metrics.jsonl logs the realised mix; a changed stage applies from the first resumed step and
is named in the resume line."""

from __future__ import annotations

import numpy as np
import pytest
from test_resume import branch

from dstrain.data.prepare import prepare

from data_fixtures import corpus_file
from ranks import run_ranks
from train_helpers import read_events, read_metrics, small_recipe, train_argv, train_each_with_poison, train_losses

pytestmark = pytest.mark.distributed

STEPS = 6
BOUNDARY = 4  # the first step of the second stage
CHANGED_STAGE = "data.stages=[{start_step: 4, weights: [0, 0, 1]}]"
# The spiking run: the guard's window (3 steps) is full by step 4, the first of the second stage; its global batch
# (samples 24-31 of the stream) is poisoned, so the guard rolls back to global_step2, a checkpoint of the first stage.
GUARD = ("train.spike_guard.enabled=true", "train.spike_guard.window=3")
POISON = (24, 32)
CLEAN = (0, 0)


@pytest.fixture(scope="module")
def staged(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("staged")
    folders = [corpus]
    for skip, name in ((300, "code"), (450, "hq")):
        out = tmp / name
        prepare(corpus_file(tmp, 150, skip), out, tokenizer=str(corpus / "tokenizer"), num_proc=1, progress=False)
        folders.append(out)
    recipe = small_recipe(
        tmp,
        corpus,
        name="staged",
        data={
            "sources": [{"path": str(f), "weight": w} for f, w in zip(folders, [3.0, 1.0, 0.0])],
            "seq_len": 32,
            "valid_fraction": 0.05,
            "stages": [{"start_step": BOUNDARY, "weights": [0.0, 1.0, 3.0]}],
        },
        train={"steps": STEPS, "checkpoint_interval": 2, "keep_last": 3},
    )
    full, spiked = tmp / "full", tmp / "spiked"
    first = [(train_argv(recipe, "zero0", full), *CLEAN), (train_argv(recipe, "zero0", spiked, *GUARD), *POISON)]
    assert run_ranks(2, train_each_with_poison, first) == [[0, 0]] * 2
    runs = {name: branch(full, tmp / name, 2) for name in ("two", "one", "changed")}
    runs["spiked"] = branch(spiked, tmp / "spiked-resumed", 2)  # killed right after the rollback
    argv = {name: train_argv(recipe, "zero0", runs[name]) for name in runs}
    argv["changed"].append(CHANGED_STAGE)
    argv["spiked"].extend(GUARD)
    second = [(argv["two"], *CLEAN), (argv["changed"], *CLEAN), (argv["spiked"], *POISON)]
    assert run_ranks(2, train_each_with_poison, second) == [[0, 0, 0]] * 2
    assert run_ranks(1, train_each_with_poison, [(argv["one"], *CLEAN)]) == [[0]]
    for name in ("two", "one", "changed"):  # resumed, not restarted
        assert [(e["step"], e["tag"]) for e in read_events(runs[name])] == [(2, "global_step2")]
    return full, runs, spiked


def mixes(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("mix_")} for r in read_metrics(run) if "split" not in r]


def test_metrics_log_the_realised_mix_of_each_stage(staged):
    full, _, _ = staged
    logged = mixes(full)
    corpus = next(k for k in logged[0] if k not in ("mix_code", "mix_hq"))
    assert len(logged) == STEPS and all(set(m) == {corpus, "mix_code", "mix_hq"} for m in logged)
    assert all(m["mix_hq"] == 0.0 and m[corpus] == pytest.approx(0.75, abs=1 / 8) for m in logged[: BOUNDARY - 1])
    assert all(m[corpus] == 0.0 and m["mix_hq"] > m["mix_code"] for m in logged[BOUNDARY - 1 :])
    evals = {r["split"] for r in read_metrics(full) if "split" in r}  # per-source validation, hq (weight 0) too
    assert evals == {f"valid/{corpus[4:]}", "valid/code", "valid/hq", "valid"}
    total = {k: sum(m[k] for m in logged[BOUNDARY - 1 :]) / (STEPS - BOUNDARY + 1) for k in logged[0]}
    assert total["mix_hq"] == pytest.approx(0.75, abs=1 / 24)  # 24 samples: within one of 3/4


def test_resume_across_the_boundary_is_bit_for_bit(staged):
    full, runs, _ = staged
    assert train_losses(runs["two"]) == train_losses(full)
    assert mixes(runs["two"]) == mixes(full)


def test_resume_on_another_world_size_reads_the_same_samples(staged):
    full, runs, _ = staged
    assert mixes(runs["one"]) == mixes(full)  # the same samples, whatever the ranks
    np.testing.assert_allclose(train_losses(runs["one"]), train_losses(full), rtol=1e-5)  # 1 vs 2 rank sums


def test_changed_stages_apply_from_the_first_resumed_step_with_one_line(staged):
    full, runs, _ = staged
    (event,) = read_events(runs["changed"])
    assert list(event["changed"]) == ["data.stages"]
    assert event["changed"]["data.stages"][1][0]["weights"] == [0.0, 0.0, 1.0]
    logged = mixes(runs["changed"])
    assert logged[: BOUNDARY - 1] == mixes(full)[: BOUNDARY - 1]
    assert all(m["mix_hq"] == 1.0 for m in logged[BOUNDARY - 1 :])


def test_a_spike_rollback_across_the_boundary_resumes_bit_for_bit(staged):
    """A spike at the second stage's first step rolls back into the first stage and skips the spiking window; a run
    killed right after the rollback resumes from the checkpoint the rollback saved again, and then reads and learns
    exactly what the uninterrupted spiked run did: neither the window nor the stage is read twice."""
    full, runs, spiked = staged
    (event,) = read_events(spiked)
    assert (event["spike_step"], event["rolled_back_to"]) == (BOUNDARY, "global_step2")
    assert event["skipped_samples"] == [2 * 8, POISON[1]]  # from global_step2's position through the spiking batch
    assert train_losses(spiked)[:2] == train_losses(full)[:2] and len(train_losses(spiked)) == STEPS
    assert train_losses(runs["spiked"]) == train_losses(spiked)
    assert mixes(runs["spiked"]) == mixes(spiked)
    assert [e["event"] for e in read_events(runs["spiked"])] == ["spike", "resume"]
