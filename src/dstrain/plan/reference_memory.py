"""What a preference recipe's reference pass holds and costs, for ``dstrain estimate`` and ``dstrain plan``: a phase
of its own (``Part.reference``), before step 1, whose peak can exceed training's.

What the code does today (dstrain.train.preference_steps.reference_pass): the pass runs once the engine is built,
so the training state at rest is held beside it (parameters, fp32 master weights, Adam moments, ZeRO-3's flat
gradient partition, a weight average: ``at_rest``); every rank then loads init_from whole, in fp32, as a plain model
(``GPT(config)``, ``load_state_dict``, ``.to(device)``), whatever TP, PP, EP or ZeRO-3 shard in training, and scores
its share of the pairs with no-grad forwards of micro_batch whole samples (no SP):

    reference model, whole     4·Ψ_total                      on the device, every rank
    no-grad forward            4·T·max(2V + d, 3·(d + f))     T = micro_batch x seq_len; the logits and their
                                                              log-softmax (fp32) at the head, or one block's
                                                              residual, norm and MLP (SwiGLU: f = d_ff)
    host, per rank             8·Ψ_total                      init_from's fp32 state dict and the model built on the
                                                              host before it moves (the state dict is kept to the end)

tests/test_estimate_reference.py checks the forward's term against the live tensors of a no-grad forward and
its completion log-probs (at most 2% over them). The pass's time: forward FLOPs only (flops_per_token / 3, which
counts attention), over every rank, at the device's fp32 rate, since the plain model runs in fp32: on an H100
that rate is a fifteenth of bf16's (``reference_seconds_per_token``).

Not counted: a loss without a reference (simpo) has no pass, and a run whose scores are kept already
(dstrain.train.reference_scores) skips it; the estimate counts it all the same (the first run computes them).
A model whose whole fp32 weights do not fit one device cannot be scored this way: the pass would have to run on
the engine's sharded model instead (not built).
"""

from __future__ import annotations

from dstrain.config import Recipe
from dstrain.plan.memory_parts import Part
from dstrain.strategy.resolve import Strategy

HELD_AT_REST = ("parameters", "optimizer states", "weight average")


def has_reference_pass(recipe: Recipe) -> bool:
    """A preference recipe whose loss compares against a reference (every loss but simpo)."""
    return recipe.preference is not None and recipe.preference.loss != "simpo"


def forward_bytes(recipe: Recipe, micro_batch: int) -> int:
    """The no-grad forward's transient peak, fp32: the head's logits and log-softmax, or one block's (module doc)."""
    m, tokens = recipe.model, micro_batch * recipe.data.seq_len
    return 4 * tokens * max(2 * m.vocab_size + m.d_model, 3 * (m.d_model + m.ff_dim))


def at_rest(parts: list[Part], zero_stage: int) -> None:
    """Set each training part's ``reference``: what the built engine holds between steps (its ``step`` bytes) for
    parameters, optimizer states (DeepSpeed's ZeRO-1/2/3 allocate the moments when built; ZeRO-0's torch AdamW at
    its first step, so there they are an upper bound) and a weight average, and ZeRO-3's gradient partition (one
    flat buffer allocated when built); the rest is allocated by a step."""
    for part in parts:
        held = part.group in HELD_AT_REST
        held |= zero_stage == 3 and part.group == "gradients" and "partition" in part.name and "copy" not in part.name
        part.reference = part.step if held else 0


def reference_parts(recipe: Recipe, strategy: Strategy, params_total: int) -> list[Part]:
    """The reference pass's own parts (module doc); ``params_total``: the whole model's parameters."""
    whole = 4 * params_total
    return [
        Part("reference pass", "reference model (fp32), whole", "device", 0, 0, "4Ψ_total", reference=whole),
        Part(
            "reference pass",
            "reference forward, no grad (logits, log-softmax)",
            "device",
            0,
            0,
            "4·T·max(2V + d, 3(d + f))",
            reference=forward_bytes(recipe, strategy.micro_batch),
        ),
        Part("reference pass", "init_from's state dict + model, host", "cpu", 0, 0, "8Ψ_total", reference=2 * whole),
    ]


def reference_seconds_per_token(recipe: Recipe, world: int, fp32_rate: float) -> float:
    """Seconds the reference pass spends per token of the pair folder: forward FLOPs over ``world`` ranks, each at
    ``fp32_rate`` FLOP/s."""
    from dstrain.model.counts import flops_per_token

    return flops_per_token(recipe.model, recipe.data.seq_len) / 3 / (world * fp32_rate)
