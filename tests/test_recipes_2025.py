"""Issue 50's shipped continue-recipes at real size, on one process: each recipe's model: is its published config.json
as transformers reads it (imported through dstrain's family table, no architecture field differs), its parameter
count is the published size, and its ds_config is the layout `dstrain plan` picks on the fewest 8 x 80 GiB nodes."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402

from dstrain.config import load_recipe  # noqa: E402
from dstrain.model.config import num_params  # noqa: E402
from dstrain.model.family_configs import config_from_hf  # noqa: E402
from dstrain.model.hf import architecture_diff  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# https://huggingface.co/allenai/Olmo-3-1025-7B/blob/main/config.json (the architecture keys, from memory)
OLMO3_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=100278,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    rope_theta=500000,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    sliding_window=4096,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 8,
    tie_word_embeddings=False,
)
# recipe -> (transformers config of the published config.json, family, published size in billions, rounded)
PUBLISHED = {
    "continue-olmo3-7b": (lambda: transformers.Olmo3Config(**OLMO3_7B), "olmo3", 7.3),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_recipe_model_is_the_published_config_json_and_size(name):
    make, family, billions = PUBLISHED[name]
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    theirs = config_from_hf(make(), family, "config.json")
    assert architecture_diff(recipe.model, theirs) == []
    assert round(num_params(recipe.model) / 1e9, 1) == billions


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shipped_ds_config_is_what_the_planner_picks_on_one_node(name):
    """`dstrain plan --nodes 1 --gpus-per-node 8 --device h100-sxm` (the fewest nodes: one) writes this ds_config."""
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import DEVICES, Cluster

    path = ROOT / "recipes" / f"{name}.yaml"
    shipped = json.loads((ROOT / "ds_configs" / "planned" / f"{name}-1x8-h100.json").read_text())
    found, fitting = plan(load_recipe(path), path, Cluster(DEVICES["h100-sxm"], 1, 8), "bf16", top=1)
    assert fitting > 0 and found[0].ds_config == shipped, found[0].layout.describe()
