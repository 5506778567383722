"""The planner's bytes per collective (dstrain.plan.traffic) against DeepSpeed's own communication logger.

Each layout trains 2 steps on 2 gloo ranks with ``comms_logger`` on; the logger is reset before step 2 and read
after it, so the numbers are one steady optimizer step (the first step's lazy set-up collectives are not counted).
Every collective the logger saw must be predicted to 1%, and every predicted one seen. Scalars (messages of at most
16 bytes: the loss, the gradient norm, the overflow flag) and the pipeline's loss broadcast are left out, as the
model leaves them out. All layouts run in one spawn of 2 ranks (one process group, layouts one after another);
each test checks one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain.plan.time_model import expert_share, layout_counts
from dstrain.plan.traffic import step_traffic
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

from ranks import run_ranks
from train_helpers import ROOT, small_recipe, train_argv

STEP = 2  # the optimizer step whose collectives are compared
SCALAR = 16  # bytes: messages this small are scalars
# name: (shipped ds_config, changes to it, MoE recipe). micro-batch 2: 2 accumulation steps on 2 data-parallel ranks
# (ZeRO-2 and -3 reduce per micro-batch, ZeRO-1 once per step); persistence threshold 0: ZeRO-3 gathers every
# parameter, not only the small ones it keeps whole.
LAYOUTS = {
    "zero1": ("zero1", {"train_micro_batch_size_per_gpu": 2}, False),
    "zero2": ("zero2", {"train_micro_batch_size_per_gpu": 2}, False),
    "zero3": ("zero3", {"train_micro_batch_size_per_gpu": 2, "zero": {"stage3_param_persistence_threshold": 0}}, False),
    "tp2": ("tp2_zero1", {}, False),
    "pp2": ("pp2_zero1", {"train_micro_batch_size_per_gpu": 2}, False),
    "dualpipev2": (
        "pp2_zero1",
        {"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2, "schedule": "dualpipev"}},
        False,
    ),
    "sp2": ("sp2_zero1", {}, False),
    "ep2": ("ep2_zero1", {"train_micro_batch_size_per_gpu": 2}, True),
    # the recompute dispatches and combines each MoE block's tokens again
    "ep2_recompute": (
        "ep2_zero1",
        {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"partition_activations": False}},
        True,
    ),
}


def logged_collectives(argv: list[str]) -> dict:
    """Rank target: train; return step STEP's bytes per collective as DeepSpeed's logger counts them, and the
    all-to-all capacity of each MoE layer's forwards in that step (dropless: the busiest expert's count)."""
    import deepspeed.comm as dist

    from dstrain.model.moe import Router
    from dstrain.train.loop import Trainer
    from dstrain.train.run import main

    step_original, router_original = Trainer.train_step, Router.forward
    out: dict = {"bytes": {}, "capacities": [], "tokens": []}
    recording = [False]

    def train_step(self, batches):
        recording[0] = self.progress.step + 1 == STEP
        if recording[0]:
            dist.comms_logger.comms_dict.clear()
        loss = step_original(self, batches)
        if recording[0]:
            for name, sizes in dist.comms_logger.comms_dict.items():
                total = sum(size * record[0] for size, record in sizes.items() if size > SCALAR)
                if total and name != "broadcast":
                    out["bytes"][name] = total
        recording[0] = False
        return loss

    def router_forward(self, x, *args, **kwargs):
        result = router_original(self, x, *args, **kwargs)
        if recording[0] and self.training:
            out["capacities"].append(int(result[1]))
            out["tokens"].append(x.shape[0])
        return result

    Trainer.train_step, Router.forward = train_step, router_forward
    try:
        assert main(argv) == 0
    finally:
        Trainer.train_step, Router.forward = step_original, router_original
    return out


def run_all(tmp: Path, corpus: Path) -> dict:
    argvs, names = [], []
    for name, (_, _, moe) in LAYOUTS.items():
        recipe = layout_recipe(tmp, corpus, name, moe)
        argvs.append(train_argv(recipe, layout_config(tmp, name), tmp / f"run-{name}"))
        names.append(name)
    results = run_ranks(2, train_each_logged, argvs)
    return {name: [rank[i] for rank in results] for i, name in enumerate(names)}


def train_each_logged(argvs: list[list[str]]) -> list[dict]:
    return [logged_collectives(argv) for argv in argvs]


def layout_recipe(tmp: Path, corpus: Path, name: str, moe: bool) -> Path:
    model: dict = {"moe": {"num_experts": 4, "top_k": 2}} if moe else {}
    if name == "dualpipev2":  # four stages of a block each
        model["n_layer"] = 4
    return small_recipe(tmp, corpus, name=f"traffic-{name}", train={"steps": STEP}, model=model)


def layout_config(tmp: Path, name: str) -> Path:
    base, changes, _ = LAYOUTS[name]
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    changes = dict(changes)
    config["zero_optimization"].update(changes.pop("zero", {}))
    config.update(changes)
    config["comms_logger"] = {"enabled": True, "prof_all": True}
    path = tmp / f"traffic-{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def logged(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("traffic")
    return tmp, run_all(tmp, corpus)


def predicted(tmp: Path, name: str, imbalance: float) -> dict:
    recipe_file = tmp / f"traffic-{name}.yaml"
    recipe = load_recipe(recipe_file)
    config_file = tmp / f"traffic-{name}.json"
    strategy = resolve(recipe, recipe_file, load_ds_config(config_file), config_file, 2)
    counts = layout_counts(recipe, strategy)
    totals: dict = {}
    for t in step_traffic(recipe, strategy, counts, expert_share(recipe, strategy, counts), imbalance):
        totals[t.op] = totals.get(t.op, 0) + t.logged_bytes
    return totals


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_collective_match_deepspeeds_comms_logger(logged, name):
    tmp, results = logged
    ranks = results[name]
    # The busiest rank (a pipeline's last stage holds the head): what the planner times.
    seen = {op: max(r["bytes"].get(op, 0) for r in ranks) for op in set().union(*(r["bytes"] for r in ranks))}
    imbalance = 1.0
    if LAYOUTS[name][2]:  # dropless MoE: the run's busiest expert over the mean, from its routing
        moe = load_recipe(tmp / f"traffic-{name}.yaml").model.moe
        caps = ranks[0]["capacities"]
        mean = ranks[0]["tokens"][0] * moe.top_k / moe.num_experts
        imbalance = sum(caps) / len(caps) / mean
        assert imbalance >= 1.0
    expected = predicted(tmp, name, imbalance)
    assert set(seen) == set(expected), (name, seen, expected)
    for op, size in expected.items():
        assert abs(seen[op] - size) <= 0.01 * size, (name, op, seen[op], size)
