"""Issue 50's shipped continue-recipes at real size (OLMo 3, Phi-4-mini, Llama 4 Scout), on one process: each
recipe's model: is its published config.json as transformers reads it (imported through dstrain's family table, no
architecture field differs), its parameter count is the published size, and its ds_config is the layout `dstrain
plan` picks on the fewest 8 x 80 GiB nodes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402

from dstrain.model.counts import num_params  # noqa: E402
from dstrain.model.hf.convert import architecture_diff  # noqa: E402
from dstrain.model.hf.family_configs import config_from_hf  # noqa: E402
from dstrain.recipe_file import load_recipe  # noqa: E402

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
# https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/config.json (from memory; the 48 + 48 longrope
# factors are not transcribed: the recipe takes them from init_from's config.json, these stand in for them)
PHI4_MINI = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=32,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=200064,
    max_position_embeddings=131072,
    original_max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "long_factor": [1.0 + i for i in range(48)],
        "short_factor": [1.0] * 48,
    },
    sliding_window=262144,
    tie_word_embeddings=True,
    pad_token_id=None,
)
# https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json: text_config and vision_config
# (the architecture keys, from memory); no_rope_layers is left to its default (every 4th block without RoPE)
SCOUT_TEXT = dict(
    hidden_size=5120,
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    num_local_experts=16,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    attention_chunk_size=8192,
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
    vocab_size=202048,
    max_position_embeddings=10485760,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
    router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
)
SCOUT_VISION = dict(
    hidden_size=1408,
    intermediate_size=5632,
    num_hidden_layers=34,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
    projector_input_dim=4096,
    projector_output_dim=4096,
    vision_output_dim=4096,
    pixel_shuffle_ratio=0.5,
)
# https://huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json (the architecture keys, from memory)
MOONLIGHT = dict(
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    vocab_size=163840,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
)
# recipe -> (transformers config of the published config.json, family, published size in billions, rounded)
PUBLISHED = {
    "continue-olmo3-7b": (lambda: transformers.Olmo3Config(**OLMO3_7B), "olmo3", 7.3),
    "continue-phi4-mini": (lambda: transformers.Phi3Config(**PHI4_MINI), "phi3", 3.8),
    # the text model: 107.8B of the card's 109B (the rest is the vision encoder and projector, counted below)
    "continue-llama4-scout": (lambda: transformers.Llama4TextConfig(**SCOUT_TEXT), "llama4", 107.8),
    "continue-moonlight-16b-a3b": (lambda: transformers.DeepseekV3Config(**MOONLIGHT), "deepseek_v3", 16.0),
}
# Muon with model.moe trains in fp32 only (strategy/optimizer.py::MUON_MOE_IN_BF16): planned with --precision fp32
PRECISION = {"continue-moonlight-16b-a3b": "fp32"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_recipe_model_is_the_published_config_json_and_size(name):
    make, family, billions = PUBLISHED[name]
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    theirs = config_from_hf(make(), family, "config.json")
    ours = recipe.model.rope_scaling
    if ours is not None and ours.type == "longrope":  # the factors come from init_from's config.json (merged)
        assert ours.long_factor is None and ours.short_factor is None
        ours.long_factor, ours.short_factor = theirs.rope_scaling.long_factor, theirs.rope_scaling.short_factor
    assert architecture_diff(recipe.model, theirs) == []
    assert round(num_params(recipe.model) / 1e9, 1) == billions


def test_llama4_scout_is_the_published_109b_with_17b_active():
    """The text model's count is transformers' Llama4ForCausalLM's (on the meta device); with Scout's vision encoder
    and projector it is the card's "109B total"; a token runs through 17B ("17B active": one routed expert and the
    shared one in each of the 48 blocks, attention and the embeddings)."""
    import torch

    model = load_recipe(ROOT / "recipes" / "continue-llama4-scout.yaml").model
    text = transformers.Llama4TextConfig(**SCOUT_TEXT)
    with torch.device("meta"):
        theirs = transformers.Llama4ForCausalLM(text)
        whole = transformers.Llama4ForConditionalGeneration(
            transformers.Llama4Config(text_config=SCOUT_TEXT, vision_config=SCOUT_VISION)
        )
    assert num_params(model) == sum(p.numel() for p in theirs.parameters())
    assert round(sum(p.numel() for p in whole.parameters()) / 1e9) == 109
    assert round(num_params(model, active=True) / 1e9) == 17
    assert model.n_moe_layers == 48 and model.moe is not None and model.moe.input_scaling


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shipped_ds_config_is_what_the_planner_picks_on_one_node(name):
    """`dstrain plan --nodes 1 --gpus-per-node 8 --device h100-sxm` (the fewest nodes: one) writes this ds_config."""
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import DEVICES, Cluster

    path = ROOT / "recipes" / f"{name}.yaml"
    shipped = json.loads((ROOT / "ds_configs" / "planned" / f"{name}-1x8-h100.json").read_text())
    cluster = Cluster(DEVICES["h100-sxm"], 1, 8)
    found, fitting = plan(load_recipe(path), path, cluster, PRECISION.get(name, "bf16"), top=1)
    assert fitting > 0 and found[0].ds_config == shipped, found[0].layout.describe()


def test_moonlight_is_16b_with_3b_active_and_its_muon_recipe_is_refused_in_bf16_in_one_line(capsys):
    """ "Moonlight-16B-A3B": 15.96B parameters, 2.91B active per token with the embedding (the model card's 16B and
    3B); `dstrain plan` without --precision names why no bf16 layout exists and what to plan instead."""
    from dstrain.commands.cli import main as cli

    model = load_recipe(ROOT / "recipes" / "continue-moonlight-16b-a3b.yaml").model
    assert round(num_params(model) / 1e9) == 16 and round(num_params(model, active=True) / 1e9) == 3
    recipe = str(ROOT / "recipes" / "continue-moonlight-16b-a3b.yaml")
    assert cli(["plan", "--recipe", recipe, "--nodes", "1", "--gpus-per-node", "8"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("Muon with model.moe trains in fp32; plan it with --precision fp32"), error


def test_longrope_factors_come_from_init_from_and_are_required(tmp_path):
    """The shipped Phi-4-mini recipe leaves the 48 + 48 factors to init_from's config.json: a folder with them fills
    them in (model.rope_scaling merged one level deep); a model without them refuses to run, naming the key; longrope
    under sequence parallelism is refused (each rank would pick its factors from its own slice of positions)."""
    import torch
    import yaml

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.errors import DstrainError
    from dstrain.model.gpt import GPT
    from dstrain.strategy.resolve import load_ds_config, resolve

    small = dict(PHI4_MINI, hidden_size=48, intermediate_size=32, num_hidden_layers=1, num_attention_heads=3)
    small |= dict(num_key_value_heads=1, vocab_size=64, architectures=["Phi3ForCausalLM"])
    factors = dict(long_factor=[1.0 + i for i in range(6)], short_factor=[1.0] * 6)  # 16-wide heads, 12 rotated
    small["rope_parameters"] = PHI4_MINI["rope_parameters"] | factors
    transformers.Phi3Config(**small).save_pretrained(tmp_path / "phi4-mini")
    recipe = yaml.safe_load((ROOT / "recipes" / "continue-phi4-mini.yaml").read_text())
    recipe["model"] = {"rope_scaling": recipe["model"]["rope_scaling"], "doc_masking": True}
    recipe["init_from"] = str(tmp_path / "phi4-mini")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    loaded = load_recipe_and_source(tmp_path / "recipe.yaml")[0]
    assert loaded.model.rope_scaling.long_factor == small["rope_parameters"]["long_factor"]
    without = dataclasses.replace(loaded.model.rope_scaling, long_factor=None)
    model = GPT(dataclasses.replace(loaded.model, rope_scaling=without))
    with pytest.raises(DstrainError, match="model.rope_scaling.long_factor: longrope needs 6 factors"):
        model(torch.zeros(1, 4097, dtype=torch.long))  # past 4096 positions: the long factors
    sp2 = ROOT / "ds_configs" / "sp2_zero1.json"
    with pytest.raises(DstrainError, match="sequence_parallel_size with model.rope_scaling longrope"):
        resolve(loaded, str(tmp_path / "recipe.yaml"), load_ds_config(sp2), sp2, 2)
