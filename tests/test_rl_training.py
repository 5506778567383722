"""An rl: recipe through the trainer (dstrain.train) on 2 CPU ranks: ZeRO-2 and ZeRO-3 with accumulation 2 give the
same losses, norms and rewards (1e-5); a run stopped and resumed is the uninterrupted run; the RL metrics are in
metrics.jsonl; a reward path that does not resolve is refused before any work."""

from __future__ import annotations

import json

import pytest

from ranks import run_ranks
from train_helpers import ds_config, read_metrics, small_recipe, train_and_signal_at, train_argv, train_each

pytestmark = pytest.mark.distributed
WORDS = ["module", "function", "class", "return", "value", "string", "list", "file"]


def mentions_target(prompts, completions, target, **_):
    """1 when the completion holds the row's target word, else the share of its characters that are letters / 4."""
    return [1.0 if t in c else sum(ch.isalpha() for ch in c) / max(len(c), 1) / 4 for c, t in zip(completions, target)]


def rl_recipe(tmp, corpus, **rl):
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"The {w} of the", "target": w}) + "\n" for w in WORDS))
    section = {"prompts": str(prompts), "rewards": [{"function": "test_rl_training:mentions_target"}],
               "group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "loss_type": "dapo", **rl}  # fmt: skip
    return small_recipe(tmp, corpus, name="rl", rl=section, train={"global_batch": 8, "steps": 4, "eval_samples": 8})


@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("rl")
    recipe = rl_recipe(tmp, corpus)
    configs = {
        "zero2": ds_config(tmp, "zero2"),
        "zero3_accum2": ds_config(tmp, "zero3", train_micro_batch_size_per_gpu=2),
    }
    runs = {name: tmp / name for name in configs}
    assert run_ranks(2, train_each, [train_argv(recipe, configs[n], runs[n]) for n in configs]) == [[0, 0]] * 2
    stopped = tmp / "stopped"
    argv = train_argv(recipe, configs["zero2"], stopped, "train.checkpoint_interval=1")
    assert run_ranks(2, train_and_signal_at, argv, 2) == [0, 0]
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 2
    assert run_ranks(2, train_each, [argv]) == [[0]] * 2
    return runs, stopped


def train_records(run_dir):
    return [r for r in read_metrics(run_dir) if "split" not in r and "loss" in r]


def test_zero_stages_and_accumulation_give_the_same_rl_run(rl_runs):
    runs, _ = rl_runs
    base, other = train_records(runs["zero2"]), train_records(runs["zero3_accum2"])
    assert len(base) == 4 and len(other) == 4
    for a, b in zip(base, other):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-5)
        assert b["rl/reward"] == pytest.approx(a["rl/reward"], abs=1e-6)
    fields = {"rl/reward", "rl/reward_std", "rl/reward/mentions_target", "rl/zero_spread_groups", "rl/truncated",
              "rl/completion_length", "rl/entropy", "rl/clip_ratio_low", "rl/generation_share"}  # fmt: skip
    assert fields <= set(base[0])
    assert 0 < base[0]["rl/generation_share"] < 1 and 0 < base[0]["rl/completion_length"] <= 8


def test_a_stopped_and_resumed_rl_run_is_the_uninterrupted_one(rl_runs):
    runs, stopped = rl_runs
    base = train_records(runs["zero2"])
    resumed = {r["step"]: r for r in train_records(stopped)}
    assert sorted(resumed) == [1, 2, 3, 4]
    for record in base:
        assert resumed[record["step"]]["loss"] == pytest.approx(record["loss"], abs=1e-6)
        assert resumed[record["step"]]["rl/reward"] == record["rl/reward"]  # the same samples after the resume


def test_a_reward_path_that_does_not_resolve_is_refused_before_any_work(tmp_path, corpus, capsys):
    from dstrain.train.run import main

    recipe = rl_recipe(tmp_path, corpus, rewards=[{"function": "nowhere:reward"}])
    assert main(train_argv(recipe, "zero2", tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rl.rewards[0].function: cannot import nowhere" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_inside_a_rollout_resumes_on_the_same_samples(tmp_path, corpus):
    """rl.iterations 2: stopped after step 1 (the rollout's first iteration), the resumed run trains step 2 on the
    checkpoint's rollout against its first iteration's log-probs, as the uninterrupted run does."""
    recipe = rl_recipe(tmp_path, corpus, iterations=2, epsilon=0.01)
    config = ds_config(tmp_path, "zero2")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    argv = train_argv(recipe, config, stopped, "train.checkpoint_interval=1")
    assert run_ranks(2, train_each, [train_argv(recipe, config, whole)]) == [[0]] * 2
    assert run_ranks(2, train_and_signal_at, argv, 1) == [0, 0]
    assert (stopped / "checkpoints" / "global_step1" / "rl_rollout.rank1.pt").is_file()
    assert run_ranks(2, train_each, [argv]) == [[0]] * 2
    resumed = {r["step"]: r for r in train_records(stopped)}
    for record in train_records(whole):
        assert resumed[record["step"]]["loss"] == pytest.approx(record["loss"], abs=1e-6)
        assert resumed[record["step"]]["grad_norm"] == pytest.approx(record["grad_norm"], abs=1e-6)
        assert resumed[record["step"]]["rl/reward"] == record["rl/reward"]
    assert any(r["rl/clip_ratio_low"] + r["rl/clip_ratio_high"] > 0 for r in train_records(whole))  # clipped
