"""The recipe's learning-rate schedule as a torch LambdaLR.

Our own rather than DeepSpeed's schedulers: DeepSpeed has no warmup-stable-decay,
and its WarmupCosineLR expresses the floor as a ratio; the recipe owns the schedule,
so it is built from the recipe alone and handed to deepspeed.initialize.

Step ``s`` counts optimizer updates from 0, W = ``schedule.warmup_steps``, T = the run's steps,
and every kind uses the convention of ``transformers`` and Megatron-LM:

- warmup (s < W): ``lr · s / W`` — the first update uses lr 0 and the peak is reached at update W;
- ``cosine``: ``min_lr + (lr - min_lr) · ½(1 + cos(π·p))``, p = (s - W) / (T - W); equals
  ``transformers.get_cosine_with_min_lr_schedule_with_warmup(min_lr=min_lr)``;
- ``linear``: ``min_lr + (lr - min_lr) · (1 - p)``; equals
  ``get_polynomial_decay_schedule_with_warmup(power=1, lr_end=min_lr)`` (and ``get_linear_schedule_with_warmup``
  when min_lr = 0);
- ``wsd``: lr until the last D = round(T · decay_fraction) steps, which decay linearly,
  ``min_lr + (lr - min_lr) · (1 - (s - (T - D)) / D)``; equals ``get_wsd_schedule(decay_type="linear",
  min_lr_ratio=min_lr/lr)`` after warmup. On purpose, its warmup starts from 0 like the other kinds, where
  ``get_wsd_schedule`` starts its warmup from min_lr.

tests/test_schedule.py checks every kind value for value against those functions.
"""

from __future__ import annotations

import math

import torch

from dstrain.config import OptimConfig, ScheduleConfig


def lr_at(step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate of optimizer update ``step`` (0-based) of ``total_steps``; see the module docstring."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return optim.lr * step / warmup
    if schedule.kind == "wsd":
        decay_steps = max(1, round(total_steps * schedule.decay_fraction))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return optim.lr
        progress = (step - decay_start) / decay_steps
    else:
        progress = (step - warmup) / max(1, total_steps - warmup)
    progress = min(1.0, progress)
    if schedule.kind == "cosine":
        weight = 0.5 * (1 + math.cos(math.pi * progress))
    else:  # linear, and the decay phase of wsd
        weight = 1 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * weight


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, total_steps, optim, schedule) / optim.lr
    )
