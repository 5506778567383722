"""The shipped MoE recipe at real size, on one process (no ranks): continue-qwen3-30b-a3b's model: is the published
config.json as transformers reads it, its ds_config is the layout `dstrain plan` picks on the fewest 8 x 80 GiB
nodes, and `dstrain estimate` fits it there; activation checkpointing is what lets ZeRO-2 with experts over 8 ranks
fit without offload."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from dstrain.plan.memory import estimate_file  # noqa: E402
from dstrain.plan.memory_parts import GIB  # noqa: E402
from dstrain.recipe_file import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "continue-qwen3-30b-a3b.yaml"
DS_CONFIG = ROOT / "ds_configs" / "planned/continue-qwen3-30b-a3b-1x8-h100.json"

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (the architecture keys)
PUBLISHED = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_model_is_the_published_config_json():
    """Imported through transformers' Qwen3MoeConfig and dstrain's qwen3_moe table, the published config.json is the
    recipe's model: (same architecture, init and aux-loss weight); exported, the recipe writes it back."""
    import transformers

    from dstrain.model.counts import num_params
    from dstrain.model.hf.convert import architecture_diff
    from dstrain.model.hf.family_configs import config_from_hf, hf_config

    recipe = load_recipe(RECIPE)
    theirs = config_from_hf(transformers.Qwen3MoeConfig(**PUBLISHED), "qwen3_moe", "config.json")
    assert architecture_diff(recipe.model, theirs) == []
    assert (recipe.model.init_std, recipe.model.moe.aux_loss_coef) == (theirs.init_std, theirs.moe.aux_loss_coef)
    exported = hf_config(recipe.model, None, None)
    written = {key: getattr(exported, key) for key in PUBLISHED if key != "rope_theta"}
    assert written | {"rope_theta": exported.rope_parameters["rope_theta"]} == PUBLISHED
    # transformers' defaults agree where the published model kept them (the rest differs, as written out above)
    defaults = transformers.Qwen3MoeConfig()
    kept = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok")
    assert {k: getattr(defaults, k) for k in kept} == {k: PUBLISHED[k] for k in kept}
    assert (defaults.num_hidden_layers, defaults.norm_topk_prob) != (48, True)
    # Qwen's model card: 30.5B parameters, 3.3B activated
    assert round(num_params(recipe.model) / 1e9, 1) == 30.5
    assert round(num_params(recipe.model, active=True) / 1e9, 1) == 3.4  # 3.35B: the card rounds down


def test_shipped_ds_config_fits_one_node():
    recipe = load_recipe(RECIPE)
    shipped = estimate_file(recipe, DS_CONFIG, nodes=1, gpus_per_node=8)
    assert shipped.fits and shipped.peak() < 62 * GIB, shipped.peak() / GIB
    assert shipped.ep_size == 8 and shipped.offload_optimizer


@pytest.fixture
def layouts(tmp_path):
    """The shipped ds_config without offload, with and without activation checkpointing."""
    config = json.loads(DS_CONFIG.read_text())
    del config["zero_optimization"]["offload_optimizer"]
    plain, recompute = tmp_path / "plain.json", tmp_path / "recompute.json"
    plain.write_text(json.dumps(config))
    config["activation_checkpointing"] = {"partition_activations": False}
    recompute.write_text(json.dumps(config))
    return plain, recompute


def test_activation_checkpointing_lets_the_experts_fit_without_offload(layouts):
    recipe = load_recipe(RECIPE)
    plain, recompute = (estimate_file(recipe, path, nodes=1, gpus_per_node=8) for path in layouts)
    assert not plain.fits and plain.peak() > 110 * GIB  # all 48 MoE blocks' expert activations held at once
    assert recompute.fits
    experts = [next(p for p in e.parts if p.name.startswith("MoE experts")).backward for e in (plain, recompute)]
    assert experts[0] == 48 * experts[1] > 0  # one block recomputed at a time


def test_the_shipped_ds_config_is_what_the_planner_picks_on_one_node():
    """`dstrain plan --nodes 1 --gpus-per-node 8 --device h100-sxm` (the fewest nodes: one) writes this ds_config."""
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import DEVICES, Cluster

    recipe = load_recipe(RECIPE)
    found, fitting = plan(recipe, Cluster(DEVICES["h100-sxm"], 1, 8), "bf16", top=1)
    assert fitting > 0 and found[0].ds_config == json.loads(DS_CONFIG.read_text()), found[0].layout.describe()
