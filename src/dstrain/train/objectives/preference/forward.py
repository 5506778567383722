"""The model's forward under a recipe's ``preference:`` (docs/preference-tuning.md): ModelForward with the preference
loss (dstrain.train.objectives.preference.losses) in place of the LM loss, the reference's log-probs taken from its
kept scores, and the
reward metrics' sums of the pairs it met; dstrain.train.objectives.preference.steps' step sets the global batch's
counts.

In a train step each micro-batch's loss is its share of the mean over the global batch's pairs (and the RPO term's
mean over its chosen tokens), dstrain.train.objectives.preference.losses.loss_share, multiplied by dp x accumulation,
which DeepSpeed's
backward and data-parallel average divide out again; in evaluation it is the mean over the micro-batch's own pairs,
and the valid loss the pair-weighted mean. Under sequence parallelism each rank of an SP group sums its slice's
log-probs per completion, and one all-reduce adds the slices up, the gradient flowing through this rank's own slice
only: every rank of the group then holds the pairs' whole loss, and DeepSpeed's sum of the group's gradients is the
whole gradient (dstrain.train.engine.sequence's module doc). Pipeline parallelism is refused in one line by
dstrain.strategy.resolve (its last stage would need the pairs' reference scores and counts); the logits are whole
(a ds_config's tiling.loss is refused with preference:, strategy/tiling.py, so the estimate and the planner count
them whole).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dstrain.errors import DstrainError
from dstrain.train.engine import sequence
from dstrain.train.objectives.preference.losses import (
    METRICS,
    PairCounts,
    PairLogps,
    completion_logps,
    loss_share,
    metric_sums,
    pair_logps_of,
    piece_sums,
    piece_width,
)
from dstrain.train.step.forward import ModelForward

if TYPE_CHECKING:
    from dstrain.objectives.preference_config import PreferenceConfig
    from dstrain.train.step.components import Progress
    from dstrain.train.step.step_hooks import StepHooks


class PreferenceForward(ModelForward):
    """ModelForward whose micro-batch loss is the preference loss (module doc); built by ``of_engine``."""

    preference: PreferenceConfig  # the recipe's preference: section (of_engine sets it)
    shares: int  # dp x accumulation: what each train share is multiplied by (module doc)

    def __init__(self, *args, **kwargs) -> None:
        """ModelForward's arguments."""
        super().__init__(*args, **kwargs)
        self.reference: torch.Tensor | None = None  # (pairs, 4) float64, set before step 1 (preference_steps)
        self.reference_file = ""  # where they are kept
        self.counts: PairCounts | None = None  # during a train step: the global batch's pairs and chosen tokens
        # per split, since its last record: METRICS' sums over this rank's pairs, and their count
        self.sums = {split: torch.zeros(len(METRICS) + 1, dtype=torch.float64) for split in ("train", "valid")}
        self.last_eval: torch.Tensor | None = None  # the last evaluation micro-batch's metric sums and pairs

    @classmethod
    def of_engine(cls, recipe, strategy, engine, progress: Progress, hooks: StepHooks) -> PreferenceForward:
        forward = super().of_engine(recipe, strategy, engine, progress, hooks)
        assert isinstance(forward, PreferenceForward) and recipe.preference is not None
        assert not forward.pipeline  # strategy.resolve refused it
        forward.preference = recipe.preference
        forward.shares = strategy.dp_size * strategy.grad_accum
        return forward

    def _forward_loss(self, batch: dict) -> torch.Tensor:
        logps = self.pair_logps(batch)
        sums = torch.cat([metric_sums(self.preference, logps).cpu(), torch.tensor([float(logps.chosen.numel())])])
        if self.counts is not None:
            self.sums["train"] += sums
            share = loss_share(self.preference, logps, self.counts) * self.shares
            # every SP rank holds the whole share: its value counts 1/sp of it, as the LM loss's slices do (the
            # step's loss adds the group's up), its gradient all of it through this rank's slice (module doc)
            return share if self.sp_group is None else share + share.detach() * (1 / self.sp_size - 1)
        self.last_eval = sums
        own = PairCounts(float(logps.chosen.numel()), float(logps.chosen_tokens.sum()))
        return loss_share(self.preference, logps, own)  # the mean over this micro-batch's pairs

    def policy_logps(self, batch: dict) -> PairLogps:
        """The policy's log-prob sums of the batch's pairs; under SP the group's slices added up (module doc)."""
        if self.sp_group is None:
            logits = self.engine(batch["input_ids"], batch["position_ids"])
            return completion_logps(logits, batch["labels"], batch["documents"])
        width = piece_width(batch["documents"])
        part = sequence.shard(batch, self.sp_rank, self.sp_size, doc_masking=True)
        pieces = piece_sums(self.engine(part["input_ids"], part["position_ids"]), part["labels"], part["documents"],
                            width)  # fmt: skip
        whole = pieces.detach().clone()
        torch.distributed.all_reduce(whole, group=self.sp_group)
        return pair_logps_of(pieces + (whole - pieces.detach()))

    def pair_logps(self, batch: dict) -> PairLogps:
        """The policy's log-prob sums of the batch's pairs, with the reference's from the kept scores."""
        logps = self.policy_logps(batch)
        if self.reference is None:  # simpo: no reference
            return logps
        pairs = batch["pair_ids"][batch["pair_ids"] >= 0].cpu()
        ref = self.reference[pairs]
        if torch.isnan(ref[:, :2]).any():
            raise DstrainError(
                f"{self.reference_file}: no reference score for pair {int(pairs[torch.isnan(ref[:, 0])][0])}; "
                f"delete it and its .json to score the pairs again"
            )
        ref = ref.to(logps.chosen.device, logps.chosen.dtype)
        return dataclasses.replace(logps, ref_chosen=ref[:, 0], ref_rejected=ref[:, 1])

    def eval_sums(self, loss: float, tokens: int) -> torch.Tensor:
        """(loss x pairs, pairs) of the last evaluated micro-batch: the valid loss is the mean over pairs."""
        assert self.last_eval is not None
        self.sums["valid"] += self.last_eval
        pairs = float(self.last_eval[-1])
        return torch.tensor([loss * pairs, pairs], device=self.device, dtype=torch.float64)

    def metrics(self, split: str) -> dict[str, float]:
        """METRICS' means over the pairs ``split`` met since the last call, over all ranks (a collective)."""
        sums = self.sums[split].to(self.device, copy=True)
        torch.distributed.all_reduce(sums)  # model-parallel copies add to the sums and the count alike
        self.sums[split].zero_()
        pairs = max(float(sums[-1]), 1.0)
        return {name: float(value) / pairs for name, value in zip(METRICS, sums[:-1].tolist())}
