"""The seams of the engine's building (train/engine/build.py): what deepspeed.initialize receives is the strategy's
``deepspeed_config`` object itself, and the model converters (train/engine/converters.py) run on the built model
before it, freezing what none of them trains."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from train_helpers import ROOT

pytestmark = pytest.mark.unit

RECIPE = {
    "name": "seams",
    "seed": 3,
    "model": {"flavour": "llama", "vocab_size": 97, "n_layer": 2, "n_head": 4, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 2},
}


def recipe_and_strategy(tmp_path, config: dict, world_size: int = 1, **model):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import resolve

    path = tmp_path / "seams.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "model": {**RECIPE["model"], **model}}))
    recipe = load_recipe(path)
    return recipe, resolve(recipe, path, config, tmp_path / "ds.json", world_size, validate=True)


class Captured(Exception):
    """Stops build_engine at deepspeed.initialize: what it was given is all the test needs."""


def captured_initialize(monkeypatch) -> dict:
    import deepspeed

    seen: dict = {}

    def initialize(**kwargs):
        seen.update(kwargs)
        raise Captured

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    return seen


def test_deepspeed_receives_the_strategys_config_object_unedited(tmp_path, monkeypatch):
    """The resolved config is handed over as it is: the same object, equal to itself before the build, without
    dstrain's own sections (the monitor blocks, expert_parallel), which the strategy keeps beside it."""
    from dstrain.train.engine.build import build_engine, build_model

    config = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    config["tensorboard"] = {"enabled": True}
    config["csv_monitor"] = {"enabled": True}
    recipe, strategy = recipe_and_strategy(tmp_path, config)
    before = copy.deepcopy(strategy.deepspeed_config)
    seen = captured_initialize(monkeypatch)
    with pytest.raises(Captured):
        build_engine(recipe, strategy, build_model(recipe, strategy))
    assert seen["config"] is strategy.deepspeed_config
    assert seen["config"] == before
    assert not {"tensorboard", "csv_monitor", "wandb", "expert_parallel"} & set(seen["config"])
    assert strategy.resolved_ds_config["tensorboard"]["enabled"] is True  # the run folder's record keeps them


def test_expert_parallel_is_resolved_out_of_what_deepspeed_receives(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "ep2_zero1.json").read_text())
    _, strategy = recipe_and_strategy(tmp_path, config, world_size=2, moe={"num_experts": 4})
    assert strategy.ep_size == 2
    assert "expert_parallel" not in strategy.deepspeed_config
    assert strategy.resolved_ds_config["expert_parallel"] == config["expert_parallel"]


class HeadOnly:
    """A converter that trains only the output head and marks the model it converted."""

    name = "head-only"

    def convert(self, model: torch.nn.Module, strategy) -> torch.nn.Module:
        model.converted_by = self.name
        return model

    def trainable(self, name: str) -> bool:
        return name.startswith("lm_head")


def test_without_a_converter_the_model_is_untouched(tmp_path):
    from dstrain.train.engine.build import build_model
    from dstrain.train.engine.converters import apply_converters, converters_for

    recipe, strategy = recipe_and_strategy(tmp_path, json.loads((ROOT / "ds_configs" / "zero1.json").read_text()))
    model = build_model(recipe, strategy)
    assert converters_for(recipe) == []
    assert apply_converters(model, recipe, strategy) is model
    assert all(p.requires_grad for p in model.parameters())


def test_a_converter_runs_before_deepspeed_and_freezes_what_it_does_not_train(tmp_path, monkeypatch):
    from dstrain.train.engine import converters
    from dstrain.train.engine.build import build_engine, build_model

    monkeypatch.setattr(converters, "REGISTRY", [lambda recipe: HeadOnly(), lambda recipe: None])
    recipe, strategy = recipe_and_strategy(tmp_path, json.loads((ROOT / "ds_configs" / "zero1.json").read_text()))
    seen = captured_initialize(monkeypatch)
    with pytest.raises(Captured):
        build_engine(recipe, strategy, build_model(recipe, strategy))
    model = seen["model"]
    assert model.converted_by == "head-only"
    training = {name for name, p in model.named_parameters() if p.requires_grad}
    assert training and all(name.startswith("lm_head") for name in training)
    assert len(training) < len(list(model.parameters()))
