"""What train.averaging (dstrain.train.features.averaging) adds to each rank's memory, for ``dstrain estimate``.

Each rank keeps fp32 copies of the weights it holds: Ψ_avg = Ψ (the rank's model-parallel slice) under ZeRO-0/1/2
and pipelines, Ψ/N (its partition, where parameter offload puts it) under ZeRO-3. The EMA is one copy, last-N keeps N:

    weight average = 4 · (E + L) · Ψ_avg bytes,   E = 1 with an EMA (else 0), L = train.averaging.last_n (else 0)

held through the whole step. Evaluating an average also holds, for the length of the eval, a copy of the live
weights in the model's dtype (bΨ_avg) and, for last-N, one fp32 mean (4Ψ_avg): eval is not a phase this model
counts, so they are named in the formula and not added to the peak.
"""

from __future__ import annotations

import math

from dstrain.config import AveragingConfig
from dstrain.plan.memory_parts import Part
from dstrain.strategy.resolve import Strategy


def averaging_parts(config: AveragingConfig, strategy: Strategy, psi: int) -> list[Part]:
    """The weight-average part, none when averaging is off; ``psi``: parameters the rank's model-parallel slice
    holds."""
    copies = (config.ema_half_life_tokens is not None) + (config.last_n or 0)
    if not copies:
        return []
    sharded = strategy.zero_stage == 3
    held, label = (math.ceil(psi / strategy.zero_partitions), "Ψ/N") if sharded else (psi, "Ψ")
    where = (strategy.offload_param or "device") if sharded else "device"
    size = 4 * copies * held
    formula = f"4·{copies}·{label} (eval adds b{label}{' + 4' + label if config.last_n else ''})"
    return [Part("weight average", f"fp32 average, {copies} cop{'y' if copies == 1 else 'ies'}", where, size,
                      size, formula)]  # fmt: skip
