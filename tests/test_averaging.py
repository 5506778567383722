"""Weight averaging (train.averaging, dstrain.train.features.averaging) on short 2-rank fp32 runs: the averages a
checkpoint
holds equal what their formulas give on the weights read independently from the run's own checkpoints
(dstrain.checkpoint.consolidate: DeepSpeed's files, zero_to_fp32 under ZeRO-3), under every layout that shards
parameters differently; a resume mid-window continues them bit for bit; evaluating the average leaves training as
it was; export --averaged writes it."""

import argparse
import shutil

import pytest
import torch

from dstrain.commands import export

from ranks import run_ranks
from train_helpers import read_metrics, small_recipe, train_argv, train_each, train_losses

pytestmark = pytest.mark.distributed

# Tokens per step: global_batch 8 x seq_len 32 = 256, so a half-life of 512 tokens is a decay of 0.5 ** 0.5 a step.
AVERAGING = [
    "train.averaging.ema_half_life_tokens=512",
    "train.averaging.last_n=3",
    "train.averaging.last_n_every=2",
    "train.averaging.start_step=1",
]
STEPS = 7  # last-N samples steps 2, 4, 6 (the window at step 7 ends at 6); the EMA starts at step 2
# An fp32 mean of 3 states (or 6 EMA updates) against the same in fp64: a few fp32 roundings of values ~0.1.
ATOL = 1e-6
# The trainer's valid loss against `dstrain eval` of the same weights: tests/test_export.py's EVAL_RTOL (a last-bit
# difference of a micro-batch's fp32 loss); a wrong weight moves it by 1e-3 or more.
EVAL_RTOL = 1e-6
EVAL_FLAGS = ["--seq-len", "32", "--seed", "7", "--valid-fraction", "0.05", "--micro-batch", "4", "--samples", "32"]
EVAL_FLAGS += ["--data"]


def eval_each(argvs: list[list]) -> list[dict]:
    """Rank target: `dstrain eval` once per argv."""
    from dstrain.commands import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return [evaluate.evaluate(parser.parse_args([str(a) for a in args])) for args in argvs]


def checkpoint_states(run, steps, config):
    from dstrain.checkpoint.consolidate import consolidated_state_dict

    return {s: consolidated_state_dict(run / "checkpoints" / f"global_step{s}", config) for s in steps}


def read_averages(tag_dir, config):
    from dstrain.checkpoint.averaged import averaged_state_dict

    return {kind: averaged_state_dict(tag_dir, config, kind)[0] for kind in ("ema", "last_n")}


def assert_close(got, want, what):
    for name, tensor in got.items():
        err = (tensor.double() - want[name]).abs().max().item()
        assert err <= ATOL, f"{what}: {name} differs by {err:.3g}"


STRATEGIES = ["zero0", "zero1", "zero3", "pp2_zero1"]
KINDS = ("ema", "last_n")


@pytest.fixture(scope="module")
def averaged_runs(tmp_path_factory, corpus):
    """Under each strategy, one run saving every step with averaging on and one with it off, all in one 2-rank
    process group; then `dstrain eval` of each average's export (--averaged), all in one rank."""
    tmp = tmp_path_factory.mktemp("averaging")
    recipe = small_recipe(tmp, corpus)
    base = [f"train.steps={STEPS}", "train.eval_interval=3", "train.checkpoint_interval=1", "train.keep_last=20"]
    runs = {strategy: (tmp / strategy / "averaged", tmp / strategy / "live") for strategy in STRATEGIES}
    argvs = []
    for strategy, (averaged, live) in runs.items():
        argvs += [train_argv(recipe, strategy, averaged, *base, *AVERAGING), train_argv(recipe, strategy, live, *base)]
    assert run_ranks(2, train_each, argvs) == [[0] * len(argvs)] * 2
    exports = {(strategy, kind): tmp / strategy / kind for strategy in STRATEGIES for kind in KINDS}
    for (strategy, kind), out in exports.items():
        args = argparse.Namespace(
            run_dir=str(runs[strategy][0]), tag=None, out=str(out), dtype="fp32", averaged=kind, merge=False
        )
        assert export.main(args) == 0
    (evals,) = run_ranks(1, eval_each, [[out, *EVAL_FLAGS, corpus] for out in exports.values()])
    return recipe, runs, dict(zip(exports, evals))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_averages_equal_their_formulas_on_the_checkpointed_states(averaged_runs, strategy):
    """One run saving every step: last-N at step 7 is the mean of the states saved at steps 2, 4, 6; the EMA is
    ema_2 = w_2, ema_k = d ema_(k-1) + (1 - d) w_k. A second run in the same ranks, averaging off, has the same
    train losses to the bit (swapping the average in for each eval and back leaves the live weights as they were),
    and valid/averaged is logged beside valid at each eval."""
    from dstrain.recipe_file import load_recipe

    recipe, runs, evals = averaged_runs
    averaged, live = runs[strategy]
    config = load_recipe(recipe).model
    states = checkpoint_states(averaged, range(2, STEPS + 1), config)
    got = read_averages(averaged / "checkpoints" / f"global_step{STEPS}", config)
    names = set(got["last_n"])
    assert names and names <= set(states[2])
    mean = {n: sum(states[s][n].double() for s in (2, 4, 6)) / 3 for n in names}
    assert_close(got["last_n"], mean, "last-N")
    decay = 0.5 ** (256 / 512)
    ema = {n: states[2][n].double() for n in names}
    for s in range(3, STEPS + 1):
        ema = {n: decay * ema[n] + (1 - decay) * states[s][n].double() for n in names}
    assert_close(got["ema"], ema, "EMA")
    assert train_losses(averaged) == train_losses(live)
    logged = [(r["step"], r["split"]) for r in read_metrics(averaged) if "split" in r]
    assert logged == [
        (s, split) for s in (3, 6, 7) for split in ("valid", "valid/averaged/ema", "valid/averaged/last_n")
    ]
    # The trainer's eval of each average (swapped into the engine) against `dstrain eval` of its export --averaged.
    final = {r["split"]: r["loss"] for r in read_metrics(averaged) if r["step"] == STEPS and "split" in r}
    for kind in KINDS:
        assert final[f"valid/averaged/{kind}"] == pytest.approx(evals[strategy, kind]["loss"], rel=EVAL_RTOL)
    assert abs(final["valid/averaged/ema"] - final["valid"]) > 1e-3  # the average is not the live weights


def test_a_resume_mid_window_continues_the_averages_bit_for_bit(tmp_path, corpus):
    """ZeRO-3 (each rank holds a partition): a run whose step-3 checkpoint was written in the background (the window
    holds step 2 alone), resumed there, saves at step 7 the same average tensors, bit for bit, as an uninterrupted
    run, and logs the same averaged valid losses."""
    recipe = small_recipe(tmp_path, corpus)
    base = [f"train.steps={STEPS}", "train.eval_interval=3", *AVERAGING]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    background = ["train.steps=5", "train.checkpoint_interval=3", "train.async_checkpoint=true"]
    runs = [train_argv(recipe, "zero3", whole, *base), train_argv(recipe, "zero3", resumed, *base, *background)]
    assert run_ranks(2, train_each, runs) == [[0, 0]] * 2
    shutil.rmtree(resumed / "checkpoints" / "global_step5")
    (resumed / "checkpoints" / "latest").write_text("global_step3")
    assert run_ranks(2, train_each, [train_argv(recipe, "zero3", resumed, *base)]) == [[0]] * 2
    from dstrain.checkpoint import safe_load
    from dstrain.checkpoint.averaged import rank_files

    for a, b in zip(
        *(rank_files(run / "checkpoints" / f"global_step{STEPS}") for run in (whole, resumed)), strict=True
    ):
        x, y = safe_load.load(a), safe_load.load(b)
        assert x["window_steps"] == y["window_steps"] == [2, 4, 6]
        assert all(torch.equal(p, q) for p, q in zip(x["ema"], y["ema"], strict=True))
        for p, q in zip(x["window"], y["window"], strict=True):
            assert all(torch.equal(s, t) for s, t in zip(p, q, strict=True))

    def averaged_losses(run):
        return [
            (r["step"], r["split"], r["loss"]) for r in read_metrics(run) if r.get("split", "").startswith("valid/")
        ]

    assert averaged_losses(whole) == averaged_losses(resumed)
