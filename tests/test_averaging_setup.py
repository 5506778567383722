"""train.averaging without training: its recipe fields and refusals, the EMA's decay, the estimate's part, and the
one line refusing a resume whose saved average cannot be read onto the new layout."""

import json
import math
import types

import pytest
import torch
import yaml

from dstrain.config import AveragingConfig
from dstrain.errors import DstrainError
from dstrain.plan.memory import estimate
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve
from dstrain.strategy.topology import Topology
from dstrain.train.features.averaging import FILE, WeightAverager, check_resume, ema_decay

from train_helpers import ROOT

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
}


def recipe_file(tmp_path, **averaging):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "train": {**RECIPE["train"], "averaging": averaging}}))
    return path


@pytest.mark.parametrize(
    ("averaging", "fragment"),
    [
        ({"last_n": 1}, "train.averaging.last_n=1 is out of range; it must be >= 2"),
        ({"ema_half_life_tokens": 0}, "train.averaging.ema_half_life_tokens=0 is out of range"),
        ({"last_n": 2, "last_n_every": 0}, "train.averaging.last_n_every=0 is out of range"),
        ({"last_n": 2, "start_step": 4}, "train.averaging.start_step=4 leaves nothing of the run's 4 steps"),
        ({"ema_halflife_tokens": 10}, "unknown key train.averaging.ema_halflife_tokens; did you mean"),
    ],
)
def test_bad_averaging_values_are_one_line_naming_the_file_and_key(tmp_path, averaging, fragment):
    path = recipe_file(tmp_path, **averaging)
    with pytest.raises(DstrainError) as e:
        load_recipe(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ") and fragment in str(e.value)


def test_ema_decay_is_a_half_life_in_tokens():
    """Twice the tokens per step, the square of the decay: the same weight for the same tokens at any batch."""
    config = AveragingConfig(ema_half_life_tokens=1000)
    assert ema_decay(config, 1000) == 0.5
    assert math.isclose(ema_decay(config, 200) ** 2, ema_decay(config, 400), rel_tol=1e-15)
    assert ema_decay(AveragingConfig(last_n=2), 1000) is None


@pytest.mark.parametrize(("config", "held"), [("zero1", lambda psi: psi), ("zero3", lambda psi: math.ceil(psi / 2))])
def test_estimate_counts_the_average(tmp_path, config, held):
    """An EMA and last-N of 3: 4 fp32 copies of what the rank holds (the whole model; ZeRO-3: its half), added to
    the peak; none without averaging."""
    ds_path = ROOT / "ds_configs" / f"{config}.json"
    averaged = tmp_path / "a.yaml"
    averaged.write_text(recipe_file(tmp_path, ema_half_life_tokens=100, last_n=3).read_text())
    plain = recipe_file(tmp_path)  # overwrites r.yaml, a.yaml stays
    ests = []
    for path in (plain, averaged):
        recipe = load_recipe(path)
        ests.append(estimate(recipe, resolve(recipe, path, load_ds_config(ds_path), ds_path, 2), 1, 2))
    (part,) = [p for p in ests[1].parts if p.group == "weight average"]
    assert not [p for p in ests[0].parts if p.group == "weight average"]
    assert part.backward == part.step == 4 * 4 * held(ests[1].params_per_rank)
    assert ests[1].peak() - ests[0].peak() == part.step


def test_a_resume_onto_a_layout_that_splits_the_average_otherwise_is_refused(tmp_path):
    """A ZeRO-3 average (partitions per rank) resumed with whole parameters: one line, naming both layouts."""
    layout = {"world_size": 2, "partitioned": True, "pp_stages": 1, "tp_size": 1, "ep_size": 1}
    state = {"layout": layout, "names": ["w"], "shapes": [[4]], "ema": [torch.zeros(2)], "window": []}
    torch.save({**state, "ema_updates": 1, "window_steps": [], "layer_keys": None}, tmp_path / FILE.format(0))
    averager = WeightAverager.__new__(WeightAverager)  # what __init__ reads off an engine, set by hand
    averager.rank, averager.config = 0, AveragingConfig(ema_half_life_tokens=10)
    averager.layout = {**layout, "partitioned": False}
    with pytest.raises(DstrainError) as e:
        averager.load(tmp_path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{tmp_path}: its weight average")
    assert "2 ranks, ZeRO-3 partitions" in message and "onto 2 ranks, whole parameters" in message
    # The same line before any work, from the resolved ds_config (train.run's checks of its inputs).
    topology = Topology(world_size=2, zero_stage=1, dp_size=2, tp_size=1, pp_stages=1, precision="fp32")
    with pytest.raises(DstrainError) as before:
        check_resume(tmp_path, averager.config, types.SimpleNamespace(topology=topology))
    assert str(before.value) == message
    check_resume(tmp_path, AveragingConfig(), types.SimpleNamespace(topology=topology))  # averaging off: not read


def test_a_whole_model_average_is_read_onto_another_data_parallel_size(tmp_path):
    """ZeRO-1 on 2 ranks, resumed under ZeRO-2 on 4: every rank held the whole model in both, so rank 3 (which has
    no file of its own) continues from rank 0's average."""
    saved = {"world_size": 2, "partitioned": False, "pp_stages": 1, "tp_size": 1, "ep_size": 1}
    module = torch.nn.Linear(3, 2, bias=False)
    ema, window = [torch.randn(2, 3)], [[torch.randn(2, 3)], [torch.randn(2, 3)]]
    state = {"layout": saved, "names": ["weight"], "shapes": [[2, 3]], "ema": ema, "ema_updates": 4}
    torch.save({**state, "window_steps": [2, 4], "window": window, "layer_keys": None}, tmp_path / FILE.format(0))
    averager = WeightAverager.__new__(WeightAverager)  # what __init__ reads off an engine, set by hand
    averager.engine = type("Engine", (), {"module": module, "optimizer": None})()
    averager.rank, averager.config = 3, AveragingConfig(ema_half_life_tokens=10, last_n=2)
    averager.layout, averager.names, averager.shapes = {**saved, "world_size": 4}, ["weight"], [(2, 3)]
    averager.decay = 0.5
    averager.load(tmp_path)
    assert averager.ema is not None and torch.equal(averager.ema[0], ema[0])
    assert [step for step, _ in averager.window] == [2, 4]
    assert torch.equal(averager.averaged("last_n")[0], (window[0][0] + window[1][0]) / 2)


def test_the_loss_plot_reads_the_averages(tmp_path):
    from dstrain.train.plot import read_curves

    lines = [
        {"step": 2, "loss": 5.0, "lr": 0.1},
        {"step": 2, "split": "valid", "loss": 4.0},
        {"step": 2, "split": "valid/averaged", "loss": 3.5},
        {"step": 2, "split": "valid/web", "loss": 4.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    curves = read_curves(tmp_path / "metrics.jsonl")
    assert curves == {"train": [(2, 5.0)], "valid": [(2, 4.0)], "lr": [(2, 0.1)], "valid/averaged": [(2, 3.5)]}


def test_averaging_refuses_parameters_swapped_to_nvme():
    """ZeRO-Infinity's swapped-out partitions are not in memory after a step: one line naming the ds_config's key."""
    strategy = types.SimpleNamespace(offload_param="nvme", source="ds_configs/zero3_offload_nvme_bf16.json")
    with pytest.raises(DstrainError) as e:
        WeightAverager.build(AveragingConfig(last_n=2), None, 256, strategy)
    assert str(e.value).startswith("ds_configs/zero3_offload_nvme_bf16.json: zero_optimization.offload_param ")
    assert WeightAverager.build(AveragingConfig(), None, 256, strategy) is None  # off
