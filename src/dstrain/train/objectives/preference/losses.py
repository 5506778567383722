"""Preference losses on completion log-prob sums: DPO (sigmoid) and its variants, per pair, and the global batch's
loss as a sum of per-rank shares (docs/preference-tuning.md has each formula).

A pair's inputs are the policy's log-prob sums of the chosen and rejected completions (their learned tokens only),
the reference's (the recipe's init_from, scored once before training; zeros for the reference-free simpo), and the
completions' token counts (ipo and simpo normalise by them). Every loss but the RPO term is a mean over pairs; the RPO
term (``sft_weight``) is the chosen answers' token-mean negative log-likelihood over the batch. Both are means over
the *global* batch: each rank's share divides its sums by the global batch's pair and chosen-token counts
(``PairCounts``), so the shares add up to the same loss whatever the split into ranks and micro-batches (the idea of
dstrain.train.step.steps' learned-token divisor). ``tests/test_preference_losses.py`` proves every per-pair loss equal
to
TRL's DPOTrainer's on the same log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dstrain.objectives.preference_config import PreferenceConfig


@dataclass(frozen=True)
class PairLogps:
    """Per pair (1-D tensors of one length): log-prob sums of each completion, the reference's, token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass(frozen=True)
class PairCounts:
    """The global batch's pairs and chosen completion tokens (summed over every rank and micro-batch)."""

    pairs: float
    chosen_tokens: float


def rewards(config: PreferenceConfig, logps: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) implicit rewards: beta x (log pi - log pi_ref); simpo's beta x log pi / tokens."""
    if config.loss == "simpo":
        return (
            config.beta * logps.chosen / logps.chosen_tokens.clamp(min=1),
            config.beta * logps.rejected / logps.rejected_tokens.clamp(min=1),
        )
    return config.beta * (logps.chosen - logps.ref_chosen), config.beta * (logps.rejected - logps.ref_rejected)


def pair_losses(config: PreferenceConfig, logps: PairLogps) -> torch.Tensor:
    """Each pair's loss (the RPO term aside: ``rpo_sum``)."""
    beta, eps = config.beta, config.label_smoothing
    chosen_ratio, rejected_ratio = logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected
    margin = chosen_ratio - rejected_ratio
    if config.loss == "sigmoid":
        return -F.logsigmoid(beta * margin)
    if config.loss == "hinge":
        return torch.relu(1 - beta * margin)
    if config.loss == "ipo":  # per-token log-ratios, as TRL (and the IPO authors' results) normalise them
        normalised = chosen_ratio / logps.chosen_tokens.clamp(min=1) - rejected_ratio / logps.rejected_tokens.clamp(
            min=1
        )
        return (normalised - 1 / (2 * beta)) ** 2
    if config.loss == "robust":
        clean, flipped = -(1 - eps) * F.logsigmoid(beta * margin), -eps * F.logsigmoid(-beta * margin)
        return (clean - flipped) / (1 - 2 * eps)
    if config.loss == "apo_zero":
        return (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
    if config.loss == "simpo":
        chosen_reward, rejected_reward = rewards(config, logps)
        return -F.logsigmoid(chosen_reward - rejected_reward - config.gamma)
    raise ValueError(f"unknown preference loss {config.loss!r}")  # PreferenceConfig's Literal refuses it earlier


def rpo_sum(logps: PairLogps) -> torch.Tensor:
    """The chosen completions' negative log-likelihood summed over their tokens (RPO's term, before its divisor)."""
    return -logps.chosen.sum()


def loss_share(config: PreferenceConfig, logps: PairLogps, counts: PairCounts) -> torch.Tensor:
    """This rank's (micro-batch's) share of the global batch's loss: the shares of every rank and micro-batch add up
    to mean over pairs of ``pair_losses`` + sft_weight x (chosen NLL / chosen tokens), both over the global batch."""
    share = pair_losses(config, logps).sum() / max(counts.pairs, 1.0)
    if config.sft_weight:
        share = share + config.sft_weight * rpo_sum(logps) / max(counts.chosen_tokens, 1.0)
    return share


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


def metric_sums(config: PreferenceConfig, logps: PairLogps) -> torch.Tensor:
    """Sums over these pairs of each of METRICS, float64 (divided by the global pair count once all-reduced)."""
    chosen_reward, rejected_reward = rewards(config, logps)
    values = [chosen_reward, rejected_reward, chosen_reward - rejected_reward,
              (chosen_reward > rejected_reward).to(chosen_reward.dtype), logps.chosen, logps.rejected]  # fmt: skip
    return torch.stack([v.detach().double().sum() for v in values])


def metrics_of(sums: torch.Tensor, pairs: float) -> dict[str, float]:
    """METRICS' means from their all-reduced ``metric_sums`` over ``pairs`` pairs."""
    return {name: float(value) / max(pairs, 1.0) for name, value in zip(METRICS, sums.tolist())}


def piece_sums(logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor, width: int) -> torch.Tensor:
    """(3, batch, width): each piece's log-prob sum over its learned labels, their count, and its tokens present, of
    a micro-batch of packed pairs (dstrain.data.pair_packing); ``documents``: each label's piece in its sample (-1:
    padding), ``width``: more than its largest piece index. A sequence-parallel rank's slice gives its share: the
    SP group's pieces add up to the whole sample's."""
    batch = labels.shape[0]
    token_logps = -F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none"
    )  # 0 where ignored
    pieces = (torch.arange(batch, device=labels.device)[:, None] * width + documents.clamp(min=0)).flatten()
    inside = documents.flatten() >= 0
    learned = inside & (labels.flatten() != -100)
    sums = token_logps.new_zeros(batch * width).index_add(0, pieces[learned], token_logps[learned])
    counts = token_logps.new_zeros(batch * width).index_add(
        0, pieces[learned], token_logps.new_ones(int(learned.sum()))
    )
    present = token_logps.new_zeros(batch * width).index_add(0, pieces[inside], token_logps.new_ones(int(inside.sum())))
    return torch.stack([sums, counts, present]).view(3, batch, width)


def pair_logps_of(pieces: torch.Tensor) -> PairLogps:
    """The policy's side of PairLogps from ``piece_sums``: pieces 2k and 2k + 1 of a sample are a pair's chosen and
    rejected completions. The reference's fields are zeros, filled from the stored reference scores."""
    sums, counts, present = pieces
    pairs = present[:, 0::2] > 0  # a pair is in a sample where its chosen piece is
    zeros = sums[:, 0::2][pairs].detach() * 0
    return PairLogps(
        sums[:, 0::2][pairs], sums[:, 1::2][pairs], zeros, zeros, counts[:, 0::2][pairs], counts[:, 1::2][pairs]
    )


def piece_width(documents: torch.Tensor) -> int:
    """``piece_sums``' width for a micro-batch's (whole) ``documents``."""
    return max(int(documents.max()) + 1, 2)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor) -> PairLogps:
    """Each pair's chosen and rejected completion log-prob sums over its learned labels, and their counts, of a
    micro-batch of whole samples (``piece_sums``, ``pair_logps_of``)."""
    return pair_logps_of(piece_sums(logits, labels, documents, piece_width(documents)))
