"""The preference objective (DPO and its variants; docs/preference-tuning.md), torch-free: chosen by a recipe's
``preference:`` section (dstrain.objectives.preference_config), trained on one folder of pairs, with init_from as the
reference wherever the loss has one; it refuses pipeline parallelism and a tiled loss, and its memory term is the
reference pass before step 1. Its torch side: dstrain.train.objectives.preference.

The reference pass's memory (what dstrain.train.objectives.preference.steps.reference_pass does): a fresh run's engine
holds init_from's weights, and the policy at step 0 is the reference, so the pass is the built engine's own no-grad
forwards under the run's strategy (ZeRO-3 gathering its layers as in training, AutoTP's split projections, each SP
rank its slice). Beside them the training state at rest is held (dstrain.plan.reference_memory.at_rest); no second
model is built. One forward of micro_batch samples, each rank's slice of T = micro_batch x seq_len / sp tokens, peaks
at the head or in one block:

    no-grad forward            T·max(l·V + a·d, 3·a·(d + f))   a: the activations' bytes (2 in bf16/fp16, 4 in
                                                               fp32); l: the logits (a), their fp32 copy for the
                                                               cross-entropy (4, none in fp32) and its log-softmax
                                                               (4); or one block's residual, norm and MLP (SwiGLU:
                                                               f = d_ff)

tests/test_estimate_reference.py checks the term against the live tensors of a no-grad forward and its completion
log-probs (at most 2% over them). Not counted: a loss without a reference (simpo) has no pass, and a run whose scores
are kept already (dstrain.train.objectives.preference.reference_scores) skips it; the estimate counts it all the same
(the first run computes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstrain.errors import DstrainError
from dstrain.objectives.objective import Objective, PassBeforeTraining

if TYPE_CHECKING:
    from dstrain.config import Recipe
    from dstrain.data.manifest import Manifest


def check(recipe: Recipe, manifests: list[Manifest], recipe_file: str) -> None:
    """The preference objective trains on one pair folder, with a reference (init_from) for a loss that needs one."""
    assert recipe.preference is not None
    folders = [s.path for s in recipe.data.sources]
    if len(folders) != 1 or manifests[0].kind != "pairs":
        raise DstrainError(
            f"{recipe_file}: preference: is set but data.sources is not one pair folder ({', '.join(folders)}); "
            f"prepare chosen/rejected pairs with `dstrain prepare --chat` and name that folder alone, or remove "
            f"preference:"
        )
    if recipe.init_from is None and recipe.preference.loss != "simpo":
        raise DstrainError(
            f"{recipe_file}: preference.loss {recipe.preference.loss} needs a reference model: set init_from (the "
            f"model the pairs' rewards are measured against), or use preference.loss: simpo (reference-free)"
        )


def forward_bytes(recipe: Recipe, micro_batch: int, sp_size: int = 1, act_bytes: int = 4) -> int:
    """The reference pass's no-grad forward: its transient peak on one rank (module doc)."""
    m, tokens = recipe.model, micro_batch * recipe.data.seq_len // sp_size
    logit_bytes = act_bytes + (4 if act_bytes < 4 else 0) + 4
    return tokens * max(logit_bytes * m.vocab_size + act_bytes * m.d_model, 3 * act_bytes * (m.d_model + m.ff_dim))


REFERENCE_PASS = PassBeforeTraining(
    what="reference forward, no grad (logits, log-softmax)",
    formula="T·max(l·V + a·d, 3·a·(d + f))",
    transient_bytes=forward_bytes,
)


def memory(recipe: Recipe) -> PassBeforeTraining | None:
    """The reference pass, for every loss that compares against a reference (all but simpo)."""
    assert recipe.preference is not None
    return None if recipe.preference.loss == "simpo" else REFERENCE_PASS


OBJECTIVE = Objective(
    name="preference",
    training="dstrain.train.objectives.preference",
    section="preference",
    data_kinds=frozenset({"pairs"}),
    chosen_by=(
        "a preference objective: add a `preference:` section (docs/preference-tuning.md); an SFT recipe would learn "
        "the rejected answers too"
    ),
    check=check,
    refuses={
        # the last stage would need the pairs' reference scores and counts (train/objectives/preference/forward.py)
        "pipeline": (
            "does not run a recipe's preference: section (docs/preference-tuning.md); use a ZeRO, AutoTP or "
            "sequence-parallel ds_config"
        ),
        # the completions' log-probs take whole logits; the estimate and the planner count them whole
        "loss_tiling": (
            "with the recipe's preference: section is not supported (the completions' log-probs are taken from "
            "whole logits); remove tiling.loss or set it to 1"
        ),
    },
    memory=memory,
)
