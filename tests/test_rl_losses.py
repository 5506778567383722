"""dstrain.train.objectives.online_rl.losses against TRL's GRPOTrainer._compute_loss (trl 1.16) on the same log-probs
and advantages (loss, its gradient, KL and clip-ratio metrics, 1e-6), and TRL's advantages on the same rewards."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dstrain.train.objectives.online_rl.losses import StepCounts, group_advantages, token_loss, token_weights

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
N, T, MAX_NEW = 6, 9, 12


def trl_loss(loss_type: str, logps, old, ref, advantages, mask, beta: float, eps: tuple[float, float]):
    """TRL's loss and metrics on one process, no accumulation: the trainer's attributes it reads, faked."""
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps[0], epsilon_high=eps[1], use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_NEW, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
    )  # fmt: skip
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    inputs = {
        "prompt_ids": torch.zeros(N, 2, dtype=torch.long), "prompt_mask": torch.ones(N, 2),
        "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask.float(),
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().float(),
    }  # fmt: skip
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_loss_equals_trl(loss_type, beta):
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([9, 3, 5, 1, 7, 9])
    mask = torch.arange(T)[None] < lengths[:, None]
    base = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = base + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)  # a reused batch: ratios clip
    ref = base + 0.1 * torch.randn(N, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    eps = (0.2, 0.28)
    ours_logps, trl_logps = base.clone().requires_grad_(), base.clone().requires_grad_()
    counts = StepCounts(completions=N, tokens=int(mask.sum()), max_new_tokens=MAX_NEW)
    ours = token_loss(ours_logps, old, advantages, eps[0], eps[1], beta, ref)
    loss = (ours.loss * token_weights(mask, loss_type, counts)).sum()
    expected, metrics = trl_loss(loss_type, trl_logps, old, ref, advantages, mask, beta, eps)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, rtol=0, atol=1e-6)
    m = mask.double()
    low, high = (ours.low_clipped * m).sum() / m.sum(), (ours.high_clipped * m).sum() / m.sum()
    assert abs(low.item() - metrics["clip_ratio/low_mean"][0]) < 1e-6
    assert abs(high.item() - metrics["clip_ratio/high_mean"][0]) < 1e-6
    assert 0 < low.item() + high.item() < 1  # the case clips some tokens, not all
    if beta:
        assert abs(((ours.kl * m).sum() / m.sum()).item() - metrics["kl"][0]) < 1e-6


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    """TRL's formula (grpo_trainer._generate_and_score_completions) on the same rewards."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 0.0])
    ours, zero = group_advantages(rewards, 4, scale)
    mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4) if scale != "batch" else nanstd(rewards)
    expected = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert zero.tolist() == [False, True, False]


def test_equal_rewards_give_exactly_zero_loss_and_gradient():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # 0.1 x 3 / 3 is not 0.1 in floating point
    advantages, zero = group_advantages(rewards, 3, "group")
    assert zero.all() and (advantages == 0).all()
    logps = (-torch.rand(6, 4)).requires_grad_()
    mask = torch.ones(6, 4, dtype=torch.bool)
    out = token_loss(logps, None, advantages, 0.2, 0.2)
    loss = (out.loss * token_weights(mask, "grpo", StepCounts(6, 24, 4))).sum()
    loss.backward()
    assert loss.item() == 0.0 and (logps.grad == 0).all()
