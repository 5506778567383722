"""The shipped RL recipes pass the rl objective's checks, the GSM8K one fits its planned 1 x 8 H100 layout; layouts and
models RL cannot run are refused in one line before any work; the shipped rewards score as documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dstrain.errors import DstrainError
from dstrain.model.config import MoEConfig
from dstrain.objectives import online_rl
from dstrain.plan.layouts import fits
from dstrain.plan.memory import estimate_file
from dstrain.plan.memory_parts import GIB
from dstrain.plan.time_model import DEVICES, Cluster
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve
from dstrain.tasks.count_task import digit_share, next_number
from dstrain.tasks.gsm8k import exact_match, final_number

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "recipes" / "grpo-qwen2.5-0.5b-gsm8k.yaml"
TINY = ROOT / "recipes" / "grpo-tiny.yaml"
# grpo-tiny's model comes from init_from (hf/tiny, which scripts/demo makes): the tiny recipe's, given here
TINY_MODEL = ["model.flavour=llama", "model.vocab_size=4096", "model.n_layer=4", "model.n_head=4", "model.n_kv_head=2",
              "model.d_model=128"]  # fmt: skip


@pytest.mark.parametrize("recipe_file", [GSM8K, TINY], ids=lambda p: p.stem)
def test_shipped_rl_recipes_pass_the_objectives_checks(recipe_file):
    recipe = load_recipe(recipe_file, TINY_MODEL if recipe_file == TINY else [])
    assert recipe.rl is not None and recipe.train.global_batch == recipe.rl.completions_per_step
    online_rl.check(recipe, [], str(recipe_file))  # the rewards import, the model decodes, the batch is the samples


def test_the_gsm8k_recipe_fits_its_planned_layout():
    path = re.search(r"^# ds_config: (\S+)", GSM8K.read_text(), re.M).group(1)
    recipe = load_recipe(GSM8K)
    est = estimate_file(recipe, ROOT / path, 1, 8)
    assert fits(est, Cluster(DEVICES["h100-sxm"], 1, 8)) and est.peak() < 60 * GIB, est.peak() / GIB


@pytest.mark.parametrize("config, layout", [("tp2_zero1.json", "tensor"), ("sp2_zero1.json", "sequence"),
                                             ("pp2_zero1.json", "pipeline")])  # fmt: skip
def test_model_parallel_layouts_are_refused_for_rl(config, layout):
    recipe = load_recipe(TINY, TINY_MODEL)
    with pytest.raises(DstrainError, match=f"{config}: {layout} parallelism does not run a recipe's rl: section"):
        resolve(recipe, TINY, load_ds_config(ROOT / "ds_configs" / config), config, 2, check_device=False)


def test_a_model_the_kv_cache_cannot_decode_is_refused():
    recipe = load_recipe(GSM8K)
    recipe.model = dataclasses.replace(recipe.model, moe=MoEConfig(num_experts=4, top_k=2))
    with pytest.raises(DstrainError, match=r"rl: the samples are drawn with the model's KV cache.*model.moe"):
        online_rl.check(recipe, [], str(GSM8K))
    recipe = load_recipe(GSM8K, ["train.global_batch=64"])
    with pytest.raises(DstrainError, match="train.global_batch 64 is not rl.prompts_per_step 32 x rl.group_size 8"):
        online_rl.check(recipe, [], str(GSM8K))


def test_the_shipped_rewards():
    reference = "Natalia sold 48/2 = 24 clips in May.\n#### 1,072"
    assert final_number(reference) == "1072"
    completions = [
        "So 1072 in all.\n#### 1,072",
        "The answer is \\boxed{1072}.",
        "about 1071",
        "no idea",
        "#### 1072.0",
    ]
    assert exact_match(None, completions, [reference] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert digit_share(None, [" 20, 21", " abc", ""]) == [4 / 5, 0.0, 0.0]  # "20,21": 4 digits of 5 visible characters
    assert next_number(None, [" 20, 21", " 19", "x"], [20, 20, 20]) == [1.0, 0.0, 0.0]
