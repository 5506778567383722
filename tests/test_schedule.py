"""The recipe's schedule against transformers' own schedule functions, value for value (issue 12 item 3)."""

import math

import pytest
import torch

from dstrain.config import OptimConfig, ScheduleConfig
from dstrain.train.engine.schedule import build_scheduler, lr_at

LR, MIN_LR = 3e-3, 3e-4
RTOL = 1e-12  # the same formula in another arrangement: only float rounding may differ


def optimizer(lr=LR):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def reference_lrs(scheduler, steps: int) -> list[float]:
    """The lr a transformers LambdaLR gives updates 0..steps-1 (read before each optimizer step)."""
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def ours(kind: str, total: int, warmup: int, min_lr: float = MIN_LR, decay_fraction: float = 0.2) -> list[float]:
    optim = OptimConfig(lr=LR, min_lr=min_lr)
    schedule = ScheduleConfig(kind=kind, warmup_steps=warmup, decay_fraction=decay_fraction)
    return [lr_at(s, total, optim, schedule) for s in range(total)]


@pytest.mark.parametrize("total, warmup", [(10, 2), (100, 10), (37, 0), (5, 5)])
def test_cosine_is_transformers_cosine_with_min_lr(total, warmup):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    want = reference_lrs(get_cosine_with_min_lr_schedule_with_warmup(optimizer(), warmup, total, min_lr=MIN_LR), total)
    assert ours("cosine", total, warmup) == pytest.approx(want, rel=RTOL, abs=1e-18)


@pytest.mark.parametrize("total, warmup", [(10, 2), (100, 10), (37, 0)])
def test_linear_is_transformers_polynomial_decay_of_power_one(total, warmup):
    from transformers import get_linear_schedule_with_warmup, get_polynomial_decay_schedule_with_warmup

    want = reference_lrs(
        get_polynomial_decay_schedule_with_warmup(optimizer(), warmup, total, lr_end=MIN_LR, power=1.0), total
    )
    assert ours("linear", total, warmup) == pytest.approx(want, rel=RTOL, abs=1e-18)
    to_zero = reference_lrs(get_linear_schedule_with_warmup(optimizer(), warmup, total), total)
    assert ours("linear", total, warmup, min_lr=0.0) == pytest.approx(to_zero, rel=RTOL, abs=1e-18)


@pytest.mark.parametrize("total, warmup, fraction", [(10, 2, 0.2), (100, 10, 0.3), (40, 0, 0.25)])
def test_wsd_is_transformers_wsd_with_linear_decay_after_warmup(total, warmup, fraction):
    """get_wsd_schedule warms up from min_lr; ours from 0 like every other kind (a stated difference)."""
    from transformers import get_wsd_schedule

    decay = round(total * fraction)
    want = reference_lrs(
        get_wsd_schedule(
            optimizer(), warmup, decay, num_training_steps=total, decay_type="linear", min_lr_ratio=MIN_LR / LR
        ),
        total,
    )
    got = ours("wsd", total, warmup, decay_fraction=fraction)
    assert got[warmup:] == pytest.approx(want[warmup:], rel=RTOL, abs=1e-18)
    assert got[:warmup] == pytest.approx([LR * s / warmup for s in range(warmup)], rel=RTOL, abs=0)
    from_zero = reference_lrs(
        get_wsd_schedule(optimizer(), warmup, decay, num_training_steps=total, decay_type="linear"), total
    )  # min_lr_ratio 0: warmup from 0
    assert got[:warmup] == pytest.approx(from_zero[:warmup], rel=RTOL, abs=0)


def test_warmup_starts_at_zero_and_reaches_the_peak_at_update_w():
    lrs = ours("cosine", 10, 4)
    assert lrs[:5] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR], rel=RTOL)
    assert lrs[-1] > MIN_LR and math.isclose(lr_at(10, 10, OptimConfig(lr=LR, min_lr=MIN_LR), ScheduleConfig()), MIN_LR)


def test_the_scheduler_applies_lr_at_and_its_lambdas_can_be_replaced():
    opt = optimizer()
    scheduler = build_scheduler(opt, 10, OptimConfig(lr=LR, min_lr=MIN_LR), ScheduleConfig(warmup_steps=2))
    assert reference_lrs(scheduler, 10) == pytest.approx(ours("cosine", 10, 2), rel=RTOL, abs=1e-18)
    assert len(scheduler.lr_lambdas) == 1 and callable(scheduler.lr_lambdas[0])
