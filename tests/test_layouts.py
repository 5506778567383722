"""The layout seam: one list of layout parts (strategy/layouts.py) whose names key how each is applied to the model
and engine (train/engine/layouts.py) and what it costs (plan/layout_costs.py); a shipped ds_config uses the parts
its sections choose."""

from __future__ import annotations

import json

import pytest
import yaml

from train_helpers import ROOT

pytestmark = pytest.mark.unit

RECIPE = {
    "name": "parts",
    "seed": 3,
    "model": {"flavour": "llama", "vocab_size": 97, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 32},
    "train": {"global_batch": 16, "steps": 2},
}


def test_the_three_lists_name_the_same_parts():
    from dstrain.plan.layout_costs import COSTS
    from dstrain.strategy.layouts import LAYOUT_PARTS, NAMES
    from dstrain.train.engine.layouts import APPLIED

    assert len(set(NAMES)) == len(LAYOUT_PARTS) == 9
    assert set(APPLIED) == set(NAMES) == set(COSTS)


@pytest.mark.parametrize(
    "config, world, model, used",
    [
        ("zero0", 1, {}, []),
        ("zero3_bf16", 2, {}, ["zero", "activation_checkpoints"]),
        ("zero3_offload_nvme_bf16", 2, {}, ["zero", "offload", "activation_checkpoints"]),
        ("pp2_zero1", 2, {}, ["zero", "pipeline"]),
        ("tp2_zero1", 2, {}, ["zero", "tensor"]),
        ("sp2_zero1", 2, {}, ["sequence", "zero"]),
        ("ep2_zero1", 2, {"moe": {"num_experts": 4}}, ["zero", "expert"]),
    ],
)
def test_a_shipped_config_uses_the_parts_its_sections_choose(tmp_path, monkeypatch, config, world, model, used):
    from deepspeed.accelerator import get_accelerator

    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.layouts import parts_used
    from dstrain.strategy.resolve import resolve

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    path = tmp_path / "parts.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "model": {**RECIPE["model"], **model}}))
    ds = json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())
    strategy = resolve(load_recipe(path), path, ds, f"{config}.json", world, check_device=False)
    assert parts_used(strategy) == used


def test_host_checkpoints_and_tiling_are_parts_of_their_own(tmp_path):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.layouts import parts_used
    from dstrain.strategy.resolve import resolve

    path = tmp_path / "parts.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    ds |= {"activation_checkpointing": {"cpu_checkpointing": True}, "tiling": {"mlp": 2}}
    strategy = resolve(load_recipe(path), path, ds, "host.json", 1)
    assert parts_used(strategy) == ["zero", "activation_checkpoints", "host_checkpoints", "tiling"]


def test_offload_at_stage_0_is_refused_by_the_offload_part(tmp_path):
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import resolve

    path = tmp_path / "parts.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    ds = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    ds["zero_optimization"] = {"stage": 0, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(DstrainError, match=r"^z0\.json: zero_optimization\.offload_optimizer needs ZeRO stage 1, 2"):
        resolve(load_recipe(path), path, ds, "z0.json", 1)


def test_an_input_error_is_named_by_the_check_phase():
    """A check raises the key and the fix; the check phase puts its file in front, and names the other file a
    contradiction mentions."""
    from dstrain.errors import DstrainError, InputError, naming_files

    with pytest.raises(DstrainError) as error, naming_files(recipe="r.yaml", ds_config="d.json"):
        raise InputError("pins seed=3 but the recipe sets seed=7; the recipe owns it", also="recipe")
    assert str(error.value) == "d.json: pins seed=3 but r.yaml sets seed=7; the recipe owns it"
    with pytest.raises(DstrainError) as error, naming_files(recipe="r.yaml"):
        raise InputError("model.n_head=0; use a positive integer", input="recipe")
    assert str(error.value) == "r.yaml: model.n_head=0; use a positive integer"


LAYOUT_FIELDS = {
    "zero_stage",
    "tp_size",
    "pp_stages",
    "sp_size",
    "ep_size",
    "offload_optimizer",
    "offload_param",
    "activation_checkpointing",
    "host_checkpoints",
    "loss_tiles",
    "mlp_tiles",
}


def test_building_the_model_and_engine_asks_no_layout_question():
    """build_model and build_engine call the hooks of the parts a strategy uses (train/engine/layouts.py): no `if`
    of theirs reads the layout, so a new part is an entry in the lists, not a rung in a ladder of special cases."""
    import ast

    source = (ROOT / "src" / "dstrain" / "train" / "engine" / "build.py").read_text()
    functions = {
        node.name: node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name in ("build_model", "build_engine")
    }
    assert set(functions) == {"build_model", "build_engine"}
    asked = sorted(
        f"{name}: {ast.unparse(branch.test)}"
        for name, function in functions.items()
        for branch in ast.walk(function)
        if isinstance(branch, (ast.If, ast.IfExp))
        for node in ast.walk(branch.test)
        if isinstance(node, ast.Attribute) and node.attr in LAYOUT_FIELDS
    )
    assert asked == []


def test_a_training_objective_refuses_parts_by_their_names(tmp_path):
    """What an objective cannot run under is named by the parts' names (the objective seam's refusals): a part the
    sizes use is refused in one line naming it, one they do not use is not asked about."""
    from dstrain.errors import InputError
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.layouts import check_layout
    from dstrain.strategy.parallel import Shape

    path = tmp_path / "parts.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    recipe, config = load_recipe(path), json.loads((ROOT / "ds_configs" / "tp2_zero1.json").read_text())
    refused = {"tensor": "does not run this objective; use a ZeRO ds_config"}
    tensor = Shape(2, 1, tp_size=2, pp_stages=1, sp_size=1, ep_size=1, dp_size=1)
    with pytest.raises(InputError, match=r"^tensor parallelism does not run this objective; use a ZeRO ds_config$"):
        check_layout(config, recipe, tensor, refused)
    check_layout(config, recipe, tensor)  # the same layout, no objective refusing it
    plain = Shape(2, 1, tp_size=1, pp_stages=1, sp_size=1, ep_size=1, dp_size=2)
    check_layout(json.loads((ROOT / "ds_configs" / "zero1.json").read_text()), recipe, plain, refused)
