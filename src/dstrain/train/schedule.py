"""The recipe's learning-rate schedule as a torch LambdaLR.

Our own rather than DeepSpeed's schedulers: DeepSpeed has no warmup-stable-decay,
and its WarmupCosineLR expresses the floor as a ratio; the recipe owns the schedule,
so it is built from the recipe alone and handed to deepspeed.initialize.
"""
from __future__ import annotations

import math

import torch

from dstrain.config import OptimConfig, ScheduleConfig


def lr_at(step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
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
