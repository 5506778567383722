"""The trainer's preference step (a recipe's ``preference:``, docs/preference-tuning.md): TrainStep counting the global
batch's pairs for dstrain.train.preference_forward's loss, and the component that scores the reference before step 1
and puts the reward metrics in the train and valid records.

The step's loss is the mean over the global batch's pairs (and the RPO term the mean over its chosen tokens), as the
SFT step's is over its learned tokens (dstrain.train.steps): one all-reduce before the step's forwards counts the
pairs and chosen tokens of every rank's micro-batches, and the forward takes each micro-batch's share of them.

The reference's scores (dstrain.train.reference_scores) come from a plain model loaded from init_from on every rank,
each scoring a share of the pairs, kept beside the shards and reused by every later run (and resume) on the same
weights, data and packing (an interrupted pass goes on where it stopped); the key is kept in the checkpoint, and a
resume whose init_from or data gives another key is refused in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dstrain.errors import DstrainError
from dstrain.train.components import Component, Progress
from dstrain.train.forward import ModelForward
from dstrain.train.handle import RunHandle
from dstrain.train.preference import PairCounts
from dstrain.train.preference_forward import PreferenceForward
from dstrain.train.steps import TrainStep


class PreferenceStep(TrainStep):
    """TrainStep whose count is of the global batch's pairs and chosen tokens, set on the forward (module doc)."""

    def __init__(self, recipe, strategy, engine, forward: ModelForward, components: Component) -> None:
        super().__init__(recipe, strategy, engine, forward, components)
        assert isinstance(forward, PreferenceForward)
        self.pair_forward = forward

    def _count_learned(self, micro_batches: list[dict]) -> None:
        local = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in micro_batches:
            learned = batch["labels"] != -100
            chosen = learned & (batch["documents"] >= 0) & (batch["documents"] % 2 == 0)
            local += torch.stack([(batch["pair_ids"] >= 0).sum(), chosen.sum(), learned.sum()]).double()
        self.components.on_mark("counting the step's pairs")
        torch.distributed.all_reduce(local)
        pairs, chosen, learned = (v * self.strategy.dp_size / self.world for v in local.tolist())
        self.pair_forward.counts, self.learned_tokens = PairCounts(pairs, chosen), round(learned)
        self._set_divisor(1.0)  # marks a train step (the shares carry their own divisors)

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        try:
            return super().train_step(batches)
        finally:
            self.pair_forward.counts = None


class PreferenceMetrics(Component):
    """The reward metrics in the train and valid records, and the reference's key in the checkpoint."""

    state_key = "preference"

    def __init__(self, forward: PreferenceForward, reference_key: str | None) -> None:
        self.forward, self.reference_key = forward, reference_key

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "eval":
            self.forward.sums["valid"].zero_()

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return self.forward.metrics("train")

    def valid_record_fields(self) -> dict:
        return self.forward.metrics("valid")

    def state_dict(self) -> dict | None:
        return {"reference_key": self.reference_key}

    def load_state_dict(self, state: dict | None) -> None:
        saved = (state or {}).get("reference_key")
        if saved != self.reference_key:
            raise DstrainError(
                f"the checkpoint's run was scored against another reference (scores {saved}, now "
                f"{self.reference_key}): init_from or the data changed since it started; restore them or start a new "
                f"run_dir"
            )


def build(run: RunHandle) -> PreferenceMetrics | None:
    """None without ``preference:``; else the reference scored (or its kept scores read) before step 1."""
    if run.recipe.preference is None:
        return None
    forward = run.forward
    assert isinstance(forward, PreferenceForward)  # the trainer builds it for preference: (dstrain.train.loop)
    return PreferenceMetrics(forward, reference_pass(run, forward))


def reference_pass(run: RunHandle, forward: PreferenceForward) -> str | None:
    """Before step 1: the reference's (init_from's) scores of every pair, kept or computed, set on ``forward``;
    their key (None for simpo)."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.data.dataset import build_dataset
    from dstrain.data.manifest import read_manifest
    from dstrain.model.gpt import GPT
    from dstrain.train.reference_scores import reference_scores, score_pairs, scores_key, weights_hash

    recipe = run.recipe
    if forward.preference.loss == "simpo":
        return None
    assert recipe.init_from is not None  # preflight's check_pair_sources refused a reference loss without it
    d = recipe.data
    folder = d.sources[0].path
    manifest = read_manifest(folder)
    config, state, _ = load_model_source(recipe.init_from)
    key, parts = scores_key(weights_hash(state), manifest.hash, d.seq_len, d.overlong)

    def compute(partial: Path) -> np.ndarray:
        model = GPT(dataclasses.replace(config, doc_masking=True))
        model.load_state_dict(state, strict=True)
        model.to(run.device).eval()
        sets = [
            build_dataset([(folder, 1.0)], split, d.seq_len, recipe.seed, None, d.valid_fraction, overlong=d.overlong)
            for split in ("train", "valid")
        ]
        logits = lambda batch: model(batch["input_ids"], batch["position_ids"])  # noqa: E731
        # every rank a share of its own (a plain model: no collective in its forwards), one all-reduce adds them
        return score_pairs(logits, sets, manifest.documents // 2, run.strategy.micro_batch, run.rank, run.world,
                           run.device, partial)  # fmt: skip

    forward.reference = torch.from_numpy(reference_scores(folder, key, parts, compute))
    forward.reference_file = f"{folder}/reference_scores/{key}.npy"
    return key
