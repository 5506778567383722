"""Preference losses (issue 46) against TRL's DPOTrainer, the referee: its own loss code (``_compute_loss``) run on
given log-probs through a stand-in for the model's forward, per pair, for every loss type; its reward metrics; its
RPO ("sft") term; SimPO against TRL's length-normalised sigmoid with a zero reference, and against its formula."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dstrain.objectives.preference_config import PreferenceConfig
from dstrain.train.objectives.preference.losses import (
    METRICS,
    PairCounts,
    PairLogps,
    loss_share,
    metric_sums,
    metrics_of,
    pair_losses,
)

pytest.importorskip("trl", reason="TRL, the referee, is the test-only extra .[referee] (requirements.txt has it)")
from trl import DPOTrainer  # noqa: E402

TOL = 1e-6  # float64 both sides: the same formulas, summed in another order


def random_pairs(n: int = 6, seed: int = 0) -> PairLogps:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 12, (2, n), generator=g).double()
    logps = -torch.rand(4, n, generator=g, dtype=torch.float64) * tokens.repeat(2, 1) * 2
    return PairLogps(logps[0], logps[1], logps[2], logps[3], tokens[0], tokens[1])


def trl_loss(loss_types: list[str], logps: PairLogps, weights=None, **settings) -> tuple[float, dict]:
    """TRL 1.16's DPOTrainer._compute_loss on these pairs (one batch): the model's forward replaced by per-token
    log-probs that sum to each completion's given log-prob (spread evenly over its tokens), the reference's given as
    precomputed. Returns the loss and TRL's logged metrics."""
    n = logps.chosen.numel()
    tokens = torch.cat([logps.chosen_tokens, logps.rejected_tokens]).long()
    length = int(tokens.max()) + 1
    completion_mask = torch.zeros(2 * n, length, dtype=torch.long)
    for row, count in enumerate(tokens.tolist()):
        completion_mask[row, 1 : 1 + count] = 1  # position 0: the prompt
    shifted = completion_mask[:, 1:].double()
    per_token = shifted * (torch.cat([logps.chosen, logps.rejected]) / tokens.double())[:, None]
    outputs = SimpleNamespace(
        log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros_like(per_token, dtype=torch.bool),
    )  # fmt: skip
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=loss_types, loss_weights=weights or [1.0] * len(loss_types), use_weighting=False,
        beta=settings.get("beta", 0.1), label_smoothing=settings.get("label_smoothing", 0.0),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(),
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros(2 * n, length, dtype=torch.long), "attention_mask": torch.ones(2 * n, length),
        "completion_mask": completion_mask, "ref_chosen_logps": logps.ref_chosen,
        "ref_rejected_logps": logps.ref_rejected,
    }  # fmt: skip
    loss = DPOTrainer._compute_loss(stand_in, lambda **kwargs: outputs, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in stand_in._metrics["train"].items()}


def one_pair(logps: PairLogps, i: int) -> PairLogps:
    return PairLogps(*(getattr(logps, f)[i : i + 1] for f in PairLogps.__dataclass_fields__))


CASES = [("sigmoid", {}), ("hinge", {}), ("ipo", {"beta": 0.5}), ("robust", {"label_smoothing": 0.2}),
         ("apo_zero", {}), ("sigmoid", {"beta": 2.0})]  # fmt: skip


@pytest.mark.parametrize("loss, settings", CASES, ids=[f"{loss}-{s}" for loss, s in CASES])
def test_each_pairs_loss_is_trls(loss, settings):
    logps = random_pairs()
    ours = pair_losses(PreferenceConfig(loss=loss, **settings), logps)
    referee = [trl_loss([loss], one_pair(logps, i), **settings)[0] for i in range(logps.chosen.numel())]
    np.testing.assert_allclose(ours.numpy(), referee, rtol=TOL, atol=TOL)
    assert len(set(np.round(referee, 6))) == len(referee)  # the pairs differ: each compared is its own


def test_reward_metrics_are_trls():
    logps = random_pairs(8, seed=1)
    config = PreferenceConfig(beta=0.3)
    _, referee = trl_loss(["sigmoid"], logps, beta=0.3)
    ours = metrics_of(metric_sums(config, logps), 8)
    for name in METRICS:
        assert ours[name] == pytest.approx(referee[name], rel=TOL, abs=TOL), name
    assert 0 < ours["rewards/accuracies"] < 1


def test_the_rpo_term_and_the_global_batch_mean_are_trls_whatever_the_split():
    """TRL's sigmoid + w x sft over the whole batch; ours as shares of 2 "ranks" (3 + 5 pairs) divided by the global
    batch's counts, added."""
    logps = random_pairs(8, seed=2)
    config = PreferenceConfig(sft_weight=0.7)
    referee, _ = trl_loss(["sigmoid", "sft"], logps, weights=[1.0, 0.7])
    counts = PairCounts(pairs=8, chosen_tokens=float(logps.chosen_tokens.sum()))
    halves = [PairLogps(*(getattr(logps, f)[a:b] for f in PairLogps.__dataclass_fields__)) for a, b in ((0, 3), (3, 8))]
    ours = sum(loss_share(config, half, counts) for half in halves)
    assert float(ours) == pytest.approx(referee, rel=TOL)
    assert float(loss_share(config, logps, counts)) == pytest.approx(referee, rel=TOL)


def test_simpo_is_trls_normalised_sigmoid_without_reference_and_its_formula_with_gamma():
    logps = random_pairs(6, seed=3)
    zeros = torch.zeros(6, dtype=torch.float64)
    free = PairLogps(logps.chosen, logps.rejected, zeros, zeros, logps.chosen_tokens, logps.rejected_tokens)
    ours = pair_losses(PreferenceConfig(loss="simpo", beta=2.0), logps)  # the reference is ignored
    referee = [trl_loss(["sigmoid_norm"], one_pair(free, i), beta=2.0)[0] for i in range(6)]
    np.testing.assert_allclose(ours.numpy(), referee, rtol=TOL)
    with_gamma = pair_losses(PreferenceConfig(loss="simpo", beta=2.0, gamma=0.5), logps).tolist()
    for i, value in enumerate(
        with_gamma
    ):  # SimPO's eq. 6: -log sigma(beta/|yw| log pi(yw) - beta/|yl| log pi(yl) - gamma)
        c, r = (
            logps.chosen[i].item() / logps.chosen_tokens[i].item(),
            logps.rejected[i].item() / logps.rejected_tokens[i].item(),
        )
        assert value == pytest.approx(math.log1p(math.exp(-(2.0 * c - 2.0 * r - 0.5))), rel=TOL)


def test_policy_equal_to_reference_gives_ln2_for_sigmoid():
    logps = random_pairs()
    same = PairLogps(logps.chosen, logps.rejected, logps.chosen, logps.rejected, logps.chosen_tokens,
                     logps.rejected_tokens)  # fmt: skip
    assert pair_losses(PreferenceConfig(), same).tolist() == [math.log(2)] * 6
