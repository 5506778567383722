"""Online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO; docs/rl.md), torch-free: chosen by a recipe's ``rl:``
section (dstrain.objectives.rl_config). The policy samples its own completions of the prompts dataset with a KV cache
(dstrain.model.generate), reward functions named by import path score them, and the loss is GRPO's. Its torch side:
dstrain.train.objectives.online_rl.

Its data.sources are a prepared text or chat folder: the tokenizer that encodes the prompts (and decodes the
completions for the rewards), and the valid split the language-model loss is evaluated on. Each step's samples are
train.global_batch = rl.prompts_per_step x rl.group_size completions.

Layouts: ZeRO 0-3 (under ZeRO-3 the weights are gathered once per rollout); pipeline stages, tensor and sequence
parallelism and a tiled loss are refused before any work (the decode runs the whole model on each rank, the
completions' log-probs take whole logits), and so is a model the KV cache does not decode (experts, latent or local
attention, sinks, soft caps: dstrain.model.config.kv_cache_refusal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstrain.errors import DstrainError
from dstrain.objectives.objective import Objective

if TYPE_CHECKING:
    from dstrain.config import Recipe
    from dstrain.data.manifest import Manifest


def check(recipe: Recipe, manifests: list[Manifest], recipe_file: str) -> None:
    """The step's completions are the global batch; the reward functions import; a completion fits seq_len."""
    from dstrain.objectives.rl_rewards import load_rewards

    rl = recipe.rl
    assert rl is not None
    if recipe.train.global_batch != rl.completions_per_step:
        raise DstrainError(
            f"{recipe_file}: train.global_batch {recipe.train.global_batch} is not rl.prompts_per_step "
            f"{rl.prompts_per_step} x rl.group_size {rl.group_size}; set train.global_batch: {rl.completions_per_step}"
        )
    if not rl.rewards:
        raise DstrainError(f"{recipe_file}: rl.rewards is empty; name at least one package.module:function")
    if rl.max_new_tokens >= recipe.data.seq_len:
        raise DstrainError(
            f"{recipe_file}: rl.max_new_tokens {rl.max_new_tokens} leaves no room for a prompt in data.seq_len "
            f"{recipe.data.seq_len}; lower it or raise data.seq_len"
        )
    from dstrain.model.config import kv_cache_refusal

    if (why := kv_cache_refusal(recipe.model)) is not None:
        raise DstrainError(
            f"{recipe_file}: rl: the samples are drawn with the model's KV cache, and {why}; RL needs a dense model"
        )
    try:
        load_rewards(rl.rewards)
    except DstrainError as e:
        raise DstrainError(f"{recipe_file}: {e}") from None


OBJECTIVE = Objective(
    name="online_rl",
    training="dstrain.train.objectives.online_rl",
    section="rl",
    data_kinds=frozenset({"text", "chat"}),
    chosen_by="an rl: section (docs/rl.md)",
    check=check,
    refuses={
        "pipeline": "does not run a recipe's rl: section (its decode runs the whole model on each rank); use ZeRO",
        "tensor": "does not run a recipe's rl: section (its decode runs the whole model on each rank); use ZeRO",
        "sequence": "does not run a recipe's rl: section (its decode runs the whole model on each rank); use ZeRO",
        "loss_tiling": (
            "with the recipe's rl: section is not supported (the completions' log-probs are taken from whole "
            "logits); remove tiling.loss or set it to 1"
        ),
    },
)
