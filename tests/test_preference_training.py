"""The trainer's preference step on CPU ranks (gloo, fp32), issue 46: the step's loss is the mean over the global
batch's pairs whatever the accumulation, rank count, ZeRO stage, AutoTP or Ulysses SP (losses and pre-clip gradient
norms); the first
step, the policy its own reference, gives ln 2 for sigmoid; a stopped and resumed run is the uninterrupted one, also
when its reference pass was lost midway; the reward metrics are in the train and valid records."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain.data.chat_corpus import write_pair_corpus
from dstrain.data.prepare import prepare

from ranks import run_ranks
from train_helpers import (
    ROOT,
    ds_config,
    read_metrics,
    small_recipe,
    train_and_signal_at,
    train_argv,
    train_each,
)

pytestmark = pytest.mark.distributed

TEMPLATE = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
# Accumulation, rank count and ZeRO stage reorder the same fp32 sums (as the SFT step's, tests/test_sft_training.py).
RTOL = 1e-5
STEPS = 4
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("dpo")
    assert write_pair_corpus(tmp / "pairs.jsonl", max_examples=96) >= 90
    pairs = tmp / "pairs"
    prepare(
        str(tmp / "pairs.jsonl"), str(pairs), tokenizer=str(corpus / "tokenizer"), chat=True,
        chat_template=str(TEMPLATE), num_proc=1, progress=False,
    )  # fmt: skip
    reference = tmp / "reference"
    _save_reference(reference, pairs)
    recipe = small_recipe(
        tmp, pairs, name="dpo", init_from=str(reference), preference={"loss": "sigmoid", "beta": 0.5},
        data={"sources": [{"path": str(pairs)}], "seq_len": 128, "valid_fraction": 0.1, "sft": True},
        train={"global_batch": 8, "steps": STEPS, "log_interval": 1, "eval_samples": 8, "keep_last": 1,
               "checkpoint_interval": 2},
        optim={"lr": 1e-3, "min_lr": 1e-4},
    )  # fmt: skip
    one = {
        "r1_accum1": ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=8),
        "r1_accum2": ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=4),
    }
    two = {
        "r2_zero0": ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=4),
        "r2_zero1": ds_config(tmp, "zero1", train_micro_batch_size_per_gpu=4),
        "r2_zero2": ds_config(tmp, "zero2", train_micro_batch_size_per_gpu=4),
        "r2_zero3": ds_config(tmp, "zero3", train_micro_batch_size_per_gpu=4),
        "r2_tp2": ds_config(tmp, "tp2_zero1", train_micro_batch_size_per_gpu=4),
        "r2_sp2": ds_config(tmp, "sp2_zero1", train_micro_batch_size_per_gpu=4),
    }
    runs = {name: tmp / name for name in [*one, *two, "resumed", "reference_lost"]}

    def unscored(name: str) -> Path:
        """The recipe on its own copy of the pairs, without kept scores: the run scores the reference itself."""
        copy = tmp / f"pairs-{name}"
        shutil.copytree(pairs, copy, ignore=shutil.ignore_patterns("reference_scores"))
        path = tmp / f"dpo-{name}.yaml"
        path.write_text(recipe.read_text().replace(str(pairs), str(copy)))
        return path

    assert run_ranks(1, train_each, [train_argv(recipe, c, runs[n]) for n, c in one.items()]) == [[0, 0]]
    # each 2-rank strategy scores the reference under itself
    two_runs = [train_argv(unscored(n), c, runs[n]) for n, c in two.items()]
    assert run_ranks(2, train_each, two_runs) == [[0] * len(two)] * 2
    resumed = train_argv(recipe, one["r1_accum1"], runs["resumed"])
    run_ranks(1, train_and_signal_at, resumed, 2)  # stops after step 2 (a checkpoint), then resumes
    assert run_ranks(1, train_each, [resumed]) == [[0]]
    # the same run with its reference pass lost after 2 micro-batches, then started again
    lost = train_argv(unscored("reference_lost"), one["r1_accum1"], runs["reference_lost"])
    assert run_ranks(1, train_with_reference_pass_lost, lost, 2) == ["lost"]
    assert any(p.name.endswith(".npz") for p in (tmp / "pairs-reference_lost" / "reference_scores").iterdir())
    assert run_ranks(1, train_each, [lost]) == [[0]]
    return runs


def train_with_reference_pass_lost(argv: list[str], after: int) -> str:
    """Rank target: train, the reference pass keeping its progress after each micro-batch and failing after
    ``after`` of them."""
    import dstrain.train.objectives.preference.reference_scores as reference_scores
    from dstrain.train.run import main

    score_pairs, forwards = reference_scores.score_pairs, []

    def failing(forward, *args, **kwargs):
        def forward_until_lost(batch):
            if len(forwards) == after:
                raise RuntimeError("the node was lost")
            forwards.append(1)
            return forward(batch)

        return score_pairs(forward_until_lost, *args, **kwargs, save_every_s=0)

    reference_scores.score_pairs = failing
    try:
        main(argv)
    except RuntimeError as error:
        return "lost" if str(error) == "the node was lost" else repr(error)
    return "not lost"


def _save_reference(folder, pairs) -> None:
    """A random 2-block Llama model of the recipe's shape, as a Hugging Face folder: init_from, the reference."""
    from dstrain.data.manifest import read_manifest
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    vocab = -(-read_manifest(pairs).vocab_size // 64) * 64
    config = GPTConfig(flavour="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=vocab)
    torch.manual_seed(3)
    to_hf_model(config, GPT(config).state_dict()).save_pretrained(folder)


def curves(run_dir) -> tuple[list[float], list[float]]:
    records = [r for r in read_metrics(run_dir) if "split" not in r and "loss" in r]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.mark.parametrize("run", ["r1_accum2", "r2_zero0", "r2_zero1", "r2_zero2", "r2_zero3", "r2_tp2", "r2_sp2"])
def test_accumulation_rank_count_zero_stage_tp_and_sp_give_the_same_dpo_losses_and_grad_norms(pair_runs, run):
    losses, norms = curves(pair_runs["r1_accum1"])
    assert len(losses) == STEPS and losses[-1] != losses[0]  # the loss moves (step 1 runs at lr 0)
    other = curves(pair_runs[run])
    np.testing.assert_allclose(other[0], losses, rtol=RTOL)
    np.testing.assert_allclose(other[1], norms, rtol=RTOL)


@pytest.mark.parametrize("run", ["r2_zero0", "r2_zero3", "r2_tp2", "r2_sp2"])
def test_each_strategy_scores_the_reference_as_one_rank_does(pair_runs, run):
    """The reference pass runs through the run's own engine (ZeRO-3's gathered weights, AutoTP's split projections,
    SP's slices): the kept scores equal one plain rank's (fp32, reordered sums: 1e-5)."""
    tmp = pair_runs[run].parent
    one, other = kept_scores(tmp / "pairs"), kept_scores(tmp / f"pairs-{run}")
    assert one.shape == other.shape and not np.isnan(one[:, 0]).all()
    np.testing.assert_allclose(other, one, rtol=RTOL)


def test_a_resumed_run_whose_reference_scores_are_gone_is_refused(pair_runs):
    """Past step 0 the engine no longer holds init_from: the kept scores are the only reference, never scored anew
    from the policy."""
    tmp = pair_runs["reference_lost"].parent
    shutil.rmtree(tmp / "pairs-reference_lost" / "reference_scores")
    config = ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=8)
    argv = train_argv(tmp / "dpo-reference_lost.yaml", config, pair_runs["reference_lost"])
    assert run_ranks(1, train_each, [argv]) == [[2]]
    assert not (tmp / "pairs-reference_lost" / "reference_scores").exists()


def kept_scores(folder: Path) -> np.ndarray:
    """The one reference scores file kept in a pair folder."""
    (npy,) = (folder / "reference_scores").glob("*.npy")
    return np.load(npy)


def test_the_first_step_with_the_policy_as_reference_gives_ln2_and_the_records_hold_the_rewards(pair_runs):
    records = read_metrics(pair_runs["r1_accum1"])
    train = [r for r in records if "split" not in r and "loss" in r]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert train[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    valid = [r for r in records if r.get("split") == "valid"][-1]
    for record in (train[-1], valid):
        assert set(REWARDS) <= set(record)
        assert record["rewards/margins"] == pytest.approx(record["rewards/chosen"] - record["rewards/rejected"])
        assert 0 <= record["rewards/accuracies"] <= 1
    # the policy has left its reference (the direction on unseen batches of a random model is noise: pair k's rejected
    # answer is pair k + 1's chosen one; scripts/demo-dpo shows the valid reward accuracy rising from the SFT model)
    assert abs(train[-1]["rewards/margins"]) > 1e-3


def test_a_stopped_and_resumed_dpo_run_is_the_uninterrupted_one(pair_runs):
    lines = (pair_runs["resumed"] / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(line).get("event") == "resume" for line in lines)
    whole, resumed = curves(pair_runs["r1_accum1"]), curves(pair_runs["resumed"])
    assert resumed[0][-2:] == whole[0][-2:] and resumed[1][-2:] == whole[1][-2:]  # bitwise: same ranks, same order


def test_a_run_whose_reference_pass_was_lost_goes_on_to_the_uninterrupted_run(pair_runs):
    whole, resumed = curves(pair_runs["r1_accum1"]), curves(pair_runs["reference_lost"])
    assert resumed == whole  # bitwise: the resumed pass's scores are the uninterrupted pass's


def test_a_chunked_loss_is_refused_with_a_preference_recipe_and_auto_keeps_it_whole():
    """The completions' log-probs take whole logits: "auto" resolves to 1 (so the estimate counts them whole), and an
    explicit chunk count is one line naming the key."""
    from types import SimpleNamespace

    from dstrain.errors import DstrainError
    from dstrain.strategy.tiling import check_tiling

    model = SimpleNamespace(vocab_size=151936, moe=None)
    recipe = SimpleNamespace(preference=object(), data=SimpleNamespace(seq_len=4096), model=model)
    config: dict = {"tiling": {"loss": "auto"}}
    assert check_tiling(config, recipe, 8, 1, 1) == (1, 1) and config["tiling"]["loss"] == 1
    with pytest.raises(DstrainError, match=r"^tiling.loss=8 with the recipe's preference: section") as error:
        check_tiling({"tiling": {"loss": 8}}, recipe, 8, 1, 1)
    assert "\n" not in str(error.value)
    recipe.preference = None  # the same data under SFT chunks by "auto"
    assert check_tiling({"tiling": {"loss": "auto"}}, recipe, 8, 1, 1)[0] > 1
