"""GRPO's advantages and policy-gradient loss, with the normalisations of TRL's ``loss_type`` grpo, dr_grpo and dapo,
written over a whole step so that they do not depend on how its completions are split into micro-batches and ranks.

For a step of N completions o_i (G per prompt) with rewards r_i, per token t of o_i:

    A_i       = r_i - mean(r of o_i's group)          [/ (std(r of the group, or of the step) + 1e-4): scale_rewards]
    ratio_it  = exp(log pi(o_it) - log pi_old(o_it))  (1 in the first iteration on a batch: pi_old is pi, detached)
    l_it      = -min(ratio_it A_i, clip(ratio_it, 1 - eps, 1 + eps_high) A_i) + beta KL_it
    KL_it     = exp(ref_it - logp_it) - (ref_it - logp_it) - 1          (k3; beta > 0 only)

    grpo:     L = 1/N sum_i 1/|o_i| sum_t l_it
    dr_grpo:  L = 1/(N max_new_tokens) sum_i sum_t l_it
    dapo:     L = 1/(sum_i |o_i|) sum_i sum_t l_it

TRL computes each per micro-batch and averages them over accumulation and ranks, which is the same for grpo and
dr_grpo when every micro-batch holds as many completions, and for dapo by construction (its num_items_in_batch).
Here each token's weight is fixed from the step's counts (``token_weights``), and a micro-batch's loss is its share
of L: the shares of all micro-batches and ranks add up to L exactly. tests/test_rl_losses.py holds TRL's
``_compute_loss`` to it. Written here rather than called from TRL because TRL's loss is a method of its trainer.

A group whose rewards are all equal gets advantage exactly 0 (not r - mean(r), which rounding can leave at 1e-17),
so that it gives no gradient at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), zero_spread (N / group_size,) bool: the groups whose rewards are all equal) of the step's
    rewards (N,), ordered group by group."""
    grouped = rewards.double().view(-1, group_size)
    zero_spread = grouped.amax(1) == grouped.amin(1)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.double().std() + 1e-4)
    advantages = advantages.masked_fill(zero_spread[:, None], 0.0)
    return advantages.flatten().to(rewards.dtype), zero_spread


@dataclass(frozen=True)
class StepCounts:
    """What the normalisation of a step needs, over all its completions (every rank, every micro-batch)."""

    completions: int  # N
    tokens: int  # sum_i |o_i|
    max_new_tokens: int


def token_weights(mask: torch.Tensor, loss_type: str, counts: StepCounts) -> torch.Tensor:
    """Each completion token's weight in the step's loss (B, T) (module doc): L = sum of l_it x weight_it."""
    mask = mask.float()
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * counts.completions)
    if loss_type == "dr_grpo":
        return mask / (counts.completions * counts.max_new_tokens)
    assert loss_type == "dapo", loss_type
    return mask / max(counts.tokens, 1)


@dataclass
class TokenLoss:
    """l_it (B, T) and what the metrics read of it."""

    loss: torch.Tensor
    kl: torch.Tensor | None  # KL_it (beta > 0)
    low_clipped: torch.Tensor  # ratio < 1 - eps where A < 0: the clip took the gradient away
    high_clipped: torch.Tensor  # ratio > 1 + eps_high where A > 0


def token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
) -> TokenLoss:
    """logps (B, T) of the policy now (with grad), old_logps those the batch was sampled with (None: now, detached),
    advantages (B,), ref_logps (B, T) the reference's (beta > 0)."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    advantage = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantage, clipped * advantage)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = loss + beta * kl
    low = (ratio < 1 - epsilon) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    return TokenLoss(loss, kl, low, high)
