"""The recipe's lora: section (dstrain.adapters.config): typed, checked against the model in one line each."""

import pytest
import yaml

from dstrain.adapters.config import LoraConfig, target_names
from dstrain.errors import DstrainError
from dstrain.recipe_file import load_recipe

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 2, "n_kv_head": 1, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
}


def load(tmp_path, lora, **model):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "model": {**RECIPE["model"], **model}, "lora": lora}))
    return load_recipe(path)


def refused(tmp_path, lora, *fragments, **model):
    with pytest.raises(DstrainError) as e:
        load(tmp_path, lora, **model)
    message = str(e.value)
    assert "\n" not in message and "r.yaml" in message
    for fragment in fragments:
        assert fragment in message, message


def test_lora_section_parses_with_its_defaults(tmp_path):
    recipe = load(tmp_path, {"rank": 4, "alpha": 8})
    assert recipe.lora == LoraConfig(rank=4, alpha=8.0)
    assert recipe.lora.scale == 2.0
    assert LoraConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0
    assert target_names(recipe.lora, recipe.model) == (
        *("q_proj", "k_proj", "v_proj", "o_proj"),
        *("gate_proj", "up_proj", "down_proj"),
    )
    assert load(tmp_path, {"target_modules": ["o_proj", "q_proj"]}).lora.target_modules == ["o_proj", "q_proj"]
    assert load(tmp_path, None).lora is None


def test_gpt2_all_linear_has_no_gate(tmp_path):
    recipe = load(tmp_path, {}, flavour="gpt2", n_kv_head=2)
    assert "gate_proj" not in target_names(recipe.lora, recipe.model)
    gpt2 = {"flavour": "gpt2", "n_kv_head": 2}
    refused(tmp_path, {"target_modules": ["gate_proj"]}, "lora.target_modules names gate_proj", **gpt2)


@pytest.mark.parametrize(
    "lora, fragments",
    [
        ({"target_modules": ["qkv"]}, ("lora.target_modules[0]='qkv' is not one of",)),
        ({"target_modules": []}, ("lora.target_modules must name each module once",)),
        ({"rank": 17, "target_modules": ["k_proj"]}, ("lora.rank=17 is larger than k_proj (32 -> 16)", "<= 16")),
        ({"rank": 0}, ("lora.rank=0 is out of range",)),
        ({"modules_to_save": ["norm"]}, ("lora.modules_to_save[0]='norm' is not one of",)),
        ({"dropout": 1.0}, ("lora.dropout=1.0 is out of range",)),
        ({"ranks": 4}, ("unknown key lora.ranks; did you mean lora.rank?",)),
    ],
)
def test_bad_lora_sections_are_one_line(tmp_path, lora, fragments):
    refused(tmp_path, lora, *fragments)


def test_experts_are_refused_by_name(tmp_path):
    moe = {"num_experts": 2, "top_k": 1}
    refused(tmp_path, {}, "the experts' linear layers of model.moe are not adapted", moe=moe)
    recipe = load(tmp_path, {"target_modules": ["q_proj", "v_proj"]}, moe=moe)
    assert target_names(recipe.lora, recipe.model) == ("q_proj", "v_proj")
