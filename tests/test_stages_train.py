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
from train_helpers import read_events, read_metrics, small_recipe, train_argv, train_each, train_losses

pytestmark = pytest.mark.distributed

STEPS = 6
BOUNDARY = 4  # the first step of the second stage
CHANGED_STAGE = "data.stages=[{start_step: 4, weights: [0, 0, 1]}]"


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
    full = tmp / "full"
    assert run_ranks(2, train_each, [train_argv(recipe, "zero0", full)]) == [[0]] * 2
    runs = {name: branch(full, tmp / name, 2) for name in ("two", "one", "changed")}
    argv = {name: train_argv(recipe, "zero0", runs[name]) for name in runs}
    argv["changed"].append(CHANGED_STAGE)
    assert run_ranks(2, train_each, [argv["two"], argv["changed"]]) == [[0, 0]] * 2
    assert run_ranks(1, train_each, [argv["one"]]) == [[0]]
    for run in runs.values():
        assert [(e["step"], e["tag"]) for e in read_events(run)] == [(2, "global_step2")]  # resumed, not restarted
    return full, runs


def mixes(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("mix_")} for r in read_metrics(run) if "split" not in r]


def test_metrics_log_the_realised_mix_of_each_stage(staged):
    full, _ = staged
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
    full, runs = staged
    assert train_losses(runs["two"]) == train_losses(full)
    assert mixes(runs["two"]) == mixes(full)


def test_resume_on_another_world_size_reads_the_same_samples(staged):
    full, runs = staged
    assert mixes(runs["one"]) == mixes(full)  # the same samples, whatever the ranks
    np.testing.assert_allclose(train_losses(runs["one"]), train_losses(full), rtol=1e-5)  # 1 vs 2 rank sums


def test_changed_stages_apply_from_the_first_resumed_step_with_one_line(staged):
    full, runs = staged
    (event,) = read_events(runs["changed"])
    assert list(event["changed"]) == ["data.stages"]
    assert event["changed"]["data.stages"][1][0]["weights"] == [0.0, 0.0, 1.0]
    logged = mixes(runs["changed"])
    assert logged[: BOUNDARY - 1] == mixes(full)[: BOUNDARY - 1]
    assert all(m["mix_hq"] == 1.0 for m in logged[BOUNDARY - 1 :])
