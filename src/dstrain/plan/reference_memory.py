"""What a preference recipe's reference pass holds and costs, for ``dstrain estimate`` and ``dstrain plan``: a phase
of its own (``Part.reference``), before step 1.

What the code does (dstrain.train.objectives.preference.steps.reference_pass): a fresh run's engine holds init_from's
weights,
and the policy at step 0 is the reference, so the pass is the built engine's own no-grad forwards under the run's
strategy (ZeRO-3 gathering its layers as in training, AutoTP's split projections, each SP rank its slice). Beside
them the training state at rest is held (parameters, fp32 master weights, Adam moments, ZeRO-3's flat gradient
partition, a weight average: ``at_rest``); no second model is built. One forward of micro_batch samples, each rank's
slice of T = micro_batch x seq_len / sp tokens, peaks at the head or in one block:

    no-grad forward            T·max(l·V + a·d, 3·a·(d + f))   a: the activations' bytes (2 in bf16/fp16, 4 in
                                                               fp32); l: the logits (a), their fp32 copy for the
                                                               cross-entropy (4, none in fp32) and its log-softmax
                                                               (4); or one block's residual, norm and MLP (SwiGLU:
                                                               f = d_ff)

tests/test_estimate_reference.py checks the term against the live tensors of a no-grad forward and its completion
log-probs (at most 2% over them). The pass's time: forward FLOPs only (flops_per_token / 3, which counts
attention), over every rank, at the training precision's rate (``reference_seconds_per_token``).

Not counted: a loss without a reference (simpo) has no pass, and a run whose scores are kept already
(dstrain.train.objectives.preference.reference_scores) skips it; the estimate counts it all the same (the first run
computes them).
"""

from __future__ import annotations

from dstrain.config import Recipe
from dstrain.plan.memory_parts import Part
from dstrain.strategy.resolve import Strategy

HELD_AT_REST = ("parameters", "optimizer states", "weight average")


def has_reference_pass(recipe: Recipe) -> bool:
    """A preference recipe whose loss compares against a reference (every loss but simpo)."""
    return recipe.preference is not None and recipe.preference.loss != "simpo"


def forward_bytes(recipe: Recipe, micro_batch: int, sp_size: int = 1, act_bytes: int = 4) -> int:
    """The no-grad forward's transient peak on one rank (module doc)."""
    m, tokens = recipe.model, micro_batch * recipe.data.seq_len // sp_size
    logit_bytes = act_bytes + (4 if act_bytes < 4 else 0) + 4
    return tokens * max(logit_bytes * m.vocab_size + act_bytes * m.d_model, 3 * act_bytes * (m.d_model + m.ff_dim))


def at_rest(parts: list[Part], zero_stage: int) -> None:
    """Set each training part's ``reference``: what the built engine holds between steps (its ``step`` bytes) for
    parameters, optimizer states (DeepSpeed's ZeRO-1/2/3 allocate the moments when built; ZeRO-0's torch AdamW at
    its first step, so there they are an upper bound) and a weight average, and ZeRO-3's gradient partition (one
    flat buffer allocated when built); the rest is allocated by a step."""
    for part in parts:
        held = part.group in HELD_AT_REST
        held |= zero_stage == 3 and part.group == "gradients" and "partition" in part.name and "copy" not in part.name
        part.reference = part.step if held else 0


def reference_parts(recipe: Recipe, strategy: Strategy) -> list[Part]:
    """The reference pass's own part beside the training state at rest (module doc)."""
    act_bytes = 4 if strategy.precision == "fp32" else 2
    size = forward_bytes(recipe, strategy.micro_batch, strategy.sp_size, act_bytes)
    formula = "T·max(l·V + a·d, 3·a·(d + f))"
    return [Part("reference pass", "reference forward, no grad (logits, log-softmax)", "device", 0, 0, formula,
                 reference=size)]  # fmt: skip


def reference_seconds_per_token(recipe: Recipe, world: int, rate: float) -> float:
    """Seconds the reference pass spends per token of the pair folder: forward FLOPs over ``world`` ranks, each at
    ``rate`` FLOP/s (the training precision's)."""
    from dstrain.model.counts import flops_per_token

    return flops_per_token(recipe.model, recipe.data.seq_len) / 3 / (world * rate)
