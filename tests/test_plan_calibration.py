"""dstrain compare --plan's side of the planner: the calibrated engine costs in the time model (DeepSpeed's own
seconds per step and per micro-batch, by engine kind; dstrain.commands.calibrate_engine measures them, and measuring is
timing, left to dstrain compare --plan and BENCHMARKS.md, never asserted here), and the interleaved runs' step
times."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dstrain.plan.layouts import Layout
from dstrain.plan.time_model import DEVICES, Cluster, engine_kind, layout_counts, predict
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import resolve

from train_helpers import ROOT

RECIPE = ROOT / "recipes" / "gpt2-125m.yaml"


def _predict(device, layout: Layout):
    recipe = load_recipe(RECIPE)
    strategy = resolve(recipe, RECIPE, layout.ds_config("bf16", False), "c.json", 8, check_device=False)
    return strategy, predict(recipe, strategy, layout_counts(recipe, strategy), Cluster(device, 1, 8))


def test_engine_costs_add_per_step_and_per_micro_batch_of_their_kind_only():
    bare = DEVICES["h100-sxm"]
    costed = dataclasses.replace(bare, engine_costs=(("zero3", 0.5, 0.125), ("pipeline", 0.25, 0.0625)))
    for layout, per_step, per_micro in [
        (Layout(zero=3, micro=4), 0.5, 0.125),
        (Layout(zero=1, micro=4), 0.0, 0.0),  # not calibrated: nothing added
        (Layout(zero=1, micro=8, pp=2), 0.25, 0.0625),
        (Layout(zero=1, micro=8, pp=2, schedule="dualpipev"), 0.25, 0.0625),  # the pipeline engine's, as 1F1B's
    ]:
        strategy, without = _predict(bare, layout)
        _, with_costs = _predict(costed, layout)
        added = per_step + strategy.grad_accum * per_micro
        assert with_costs.engine_s == pytest.approx(added) and without.engine_s == 0.0, layout
        assert with_costs.step_s == pytest.approx(without.step_s + added), layout
    assert engine_kind(_predict(bare, Layout(zero=2, micro=4, tp=2))[0]) == "zero2"  # TP takes its ZeRO stage's


def test_parallel_costs_add_per_micro_batch_and_per_sample_to_layouts_with_that_group_only():
    bare = DEVICES["h100-sxm"]
    costed = dataclasses.replace(bare, parallel_costs=(("tp", 0.5, 0.125), ("sp", 0.25, 0.0625)))
    for layout, per_micro, per_sample in [
        (Layout(zero=1, micro=4, tp=2), 0.5, 0.125),
        (Layout(zero=1, micro=2, sp=2), 0.25, 0.0625),
        (Layout(zero=1, micro=2), 0.0, 0.0),
        (Layout(zero=1, micro=2, pp=2), 0.0, 0.0),
    ]:
        strategy, without = _predict(bare, layout)
        _, with_costs = _predict(costed, layout)
        added = strategy.grad_accum * (per_micro + strategy.micro_batch * per_sample)
        assert with_costs.engine_s == pytest.approx(without.engine_s + added), layout
        assert with_costs.step_s == pytest.approx(without.step_s + added), layout


def test_step_times_leave_out_the_first_step_of_each_stretch(tmp_path):
    """--plan's runs resume twice (three stretches): the first step of each stretch warms up and is not counted."""
    from dstrain.commands.compare_plan import step_seconds

    records = [{"step": s, "tokens_per_s": 1000.0 * s} for s in range(1, 5)]
    records += [{"step": 4, "split": "valid", "loss": 1.0}, {"event": "resume", "tag": "global_step4"}]
    records += [{"step": s, "tokens_per_s": 1000.0 * s} for s in range(5, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert step_seconds(tmp_path, 1000) == pytest.approx([1 / s for s in (2, 3, 4, 6, 7, 8)])
