"""What an objective's pass before step 1 holds and costs, for ``dstrain estimate`` and ``dstrain plan``: a phase of
its own (``Part.reference``, the estimate's "reference" phase). The objective says whether it has one and what one
forward of it peaks at (its memory term: dstrain.objectives.objective.PassBeforeTraining; the preference objective's
reference pass, dstrain.objectives.preference, is the one so far); this module puts it beside what the built engine
holds at rest, and times it.

The pass is the built engine's own no-grad forwards under the run's strategy. Beside them the training state at rest
is held (parameters, fp32 master weights, Adam moments, ZeRO-3's flat gradient partition, a weight average:
``at_rest``); no second model is built. The pass's time: forward FLOPs only (flops_per_token / 3, which counts
attention), over every rank, at the training precision's rate (``reference_seconds_per_token``).
"""

from __future__ import annotations

from dstrain.config import Recipe
from dstrain.objectives.objective import PassBeforeTraining
from dstrain.plan.memory_parts import Part
from dstrain.strategy.resolve import Strategy

HELD_AT_REST = ("parameters", "optimizer states", "weight average")


def at_rest(parts: list[Part], zero_stage: int) -> None:
    """Set each training part's ``reference``: what the built engine holds between steps (its ``step`` bytes) for
    parameters, optimizer states (DeepSpeed's ZeRO-1/2/3 allocate the moments when built; ZeRO-0's torch AdamW at
    its first step, so there they are an upper bound) and a weight average, and ZeRO-3's gradient partition (one
    flat buffer allocated when built); the rest is allocated by a step."""
    for part in parts:
        held = part.group in HELD_AT_REST
        held |= zero_stage == 3 and part.group == "gradients" and "partition" in part.name and "copy" not in part.name
        part.reference = part.step if held else 0


def reference_parts(pass_: PassBeforeTraining, recipe: Recipe, strategy: Strategy) -> list[Part]:
    """The pass's own part beside the training state at rest (module doc)."""
    act_bytes = 4 if strategy.precision == "fp32" else 2
    size = pass_.transient_bytes(recipe, strategy.micro_batch, strategy.sp_size, act_bytes)
    return [Part("reference pass", pass_.what, "device", 0, 0, pass_.formula, reference=size)]


def reference_seconds_per_token(recipe: Recipe, world: int, rate: float) -> float:
    """Seconds the pass spends per token of its data: forward FLOPs over ``world`` ranks, each at ``rate`` FLOP/s
    (the training precision's)."""
    from dstrain.model.counts import flops_per_token

    return flops_per_token(recipe.model, recipe.data.seq_len) / 3 / (world * rate)
