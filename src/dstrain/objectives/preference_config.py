"""The preference objective's settings, a recipe's ``preference:`` section (the losses are
dstrain.train.objectives.preference.losses's, each formula in docs/preference-tuning.md). No torch; it imports no
other dstrain module but ranges, so that dstrain.config can declare the section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from dstrain.ranges import Range

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "apo_zero", "simpo")


@dataclass
class PreferenceConfig:
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "apo_zero", "simpo"] = (
        "sigmoid"  # sigmoid: DPO; ipo; hinge (SLiC); robust: cDPO/rDPO with label_smoothing; apo_zero (APO); simpo:
        # reference-free, length-normalised (gamma). TRL's loss_type of the same name, except simpo (CPO's simpo)
    )
    beta: Annotated[float, Range(gt=0)] = 0.1  # the reward's scale: reward = beta x (log pi - log pi_ref) (DPO's beta)
    label_smoothing: Annotated[float, Range(ge=0, lt=0.5)] = (
        0.0  # robust: the share of pairs assumed flipped (cDPO's epsilon); 0 elsewhere
    )
    sft_weight: Annotated[float, Range(ge=0)] = (
        0.0  # RPO: this x the chosen answers' token-mean negative log-likelihood over the batch, added to the loss
    )
    gamma: Annotated[float, Range(ge=0)] = (
        0.0  # simpo: the target reward margin (SimPO's gamma; CPO's gamma_beta_ratio x beta)
    )
