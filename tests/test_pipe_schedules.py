"""The planner's pipeline bubble and held activations, simulated on DeepSpeed's own schedules
(dstrain.plan.bubble, dstrain.plan.pipe_schedules), and DualPipeV as a layout of dstrain plan."""

from __future__ import annotations

import pytest

from dstrain.plan.bubble import BACKWARD_OVER_FORWARD, bubble_fraction
from dstrain.plan.layouts import Layout, plan
from dstrain.plan.param_counts import count_params
from dstrain.plan.pipe_schedules import held_stages
from dstrain.plan.time_model import DEVICES, Cluster, predict, traffic_table
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import resolve

from train_helpers import ROOT

SHAPES = [(2, 4), (2, 16), (4, 8), (4, 13), (8, 16), (8, 64)]  # (stages, micro-batches per step)


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_simulated_1f1b_gives_the_closed_form(stages, micro_batches):
    """TrainSchedule run as a dependency graph: the textbook (stages - 1) x (F + B) of idle time on every rank,
    M x (F + B) of work, and min(stages, M) micro-batches held by the first stage."""
    assert bubble_fraction("1f1b", stages, micro_batches) == pytest.approx((stages - 1) / micro_batches)
    assert held_stages("1f1b", stages, micro_batches) == min(stages, micro_batches)


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_dualpipev_bubble_is_smaller_and_holds_half_a_stage_more(stages, micro_batches):
    """DualPipeV's ranks each run two half-size stages, and the phases fill each other's idle time: a smaller bubble
    than 1F1B's for the same stages and micro-batches (DeepSpeed's version keeps the weight gradients inside the
    backward, so not DeepSeek's zero-bubble figure), for at most half a stage's activations more per rank."""
    dual, one = bubble_fraction("dualpipev", stages, micro_batches), bubble_fraction("1f1b", stages, micro_batches)
    assert 0 < dual < one
    assert held_stages("dualpipev", stages, micro_batches) == stages + 0.5
    assert BACKWARD_OVER_FORWARD == 2.0  # the ratio both figures assume (flops_per_token's 6N: 2N forward, 4N back)


def test_plan_enumerates_dualpipev_and_writes_it_in_deepspeeds_schema(tmp_path):
    recipe_file = ROOT / "recipes" / "gpt-1.3b.yaml"
    recipe = load_recipe(recipe_file)
    cluster = Cluster(DEVICES["h100-sxm"], 2, 8)
    kept, _ = plan(recipe, cluster, "bf16", top=200)
    dual = [p for p in kept if p.layout.schedule == "dualpipev"]
    assert dual, [p.layout.describe() for p in kept]
    for p in dual:
        assert p.ds_config["pipeline"]["schedule"] == "dualpipev" and "DualPipeV" in p.layout.describe()
        again = resolve(recipe, recipe_file, p.ds_config, "plan.json", 16, check_device=False)
        assert again.pipe_schedule == "dualpipev" and again.grad_accum >= 2 * again.pp_stages


def test_dualpipev_layout_has_the_smaller_bubble_and_twice_the_hand_offs():
    """Per-rank parameters and the hand-offs' bytes of DualPipeV are checked against DeepSpeed's comms logger in
    test_plan_traffic.py (its ZeRO-1 all-reduce is the rank's gradient)."""
    recipe_file = ROOT / "recipes" / "gpt2-125m.yaml"
    recipe = load_recipe(recipe_file)
    cluster = Cluster(DEVICES["h100-sxm"], 1, 8)
    strategies = {
        schedule: resolve(
            recipe, recipe_file, Layout(zero=1, micro=8, pp=2, schedule=schedule).ds_config("bf16", False), "c.json", 8
        )
        for schedule in ("1f1b", "dualpipev")
    }
    counts = {s: count_params(recipe.model, pp=2, schedule=s) for s in strategies}
    one, dual = (predict(recipe, strategies[s], counts[s], cluster) for s in ("1f1b", "dualpipev"))
    assert dual.bubble_s < one.bubble_s and dual.compute_s == pytest.approx(one.compute_s)
    sent = {
        s: sum(t.wire_bytes for t in traffic_table(recipe, strategies[s], counts[s]) if t.group == "pp") for s in counts
    }
    assert sent["dualpipev"] == pytest.approx(2 * sent["1f1b"])
