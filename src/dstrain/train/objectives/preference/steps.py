"""The trainer's preference step (a recipe's ``preference:``, docs/preference-tuning.md): TrainStep counting the global
batch's pairs for dstrain.train.objectives.preference.forward's loss, and the component that scores the reference
before step 1
and puts the reward metrics in the train and valid records.

The step's loss is the mean over the global batch's pairs (and the RPO term the mean over its chosen tokens), as the
SFT step's is over its learned tokens (dstrain.train.step.steps): one all-reduce before the step's forwards counts the
pairs and chosen tokens of every rank's micro-batches, and the forward takes each micro-batch's share of them.

The reference's scores (dstrain.train.objectives.preference.reference_scores) come, in a fresh run, from the engine
itself before step 1:
init_from's weights under the run's own strategy, each data-parallel replica scoring a share of the pairs. They are
kept beside the shards and reused by every later run (and resume) on the same weights, data and packing (an
interrupted pass goes on where it stopped); the key is kept in the checkpoint, and a resume whose init_from or data
gives another key is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dstrain.data.dataset import build_dataset
from dstrain.errors import DstrainError
from dstrain.train.objectives.preference.forward import PreferenceForward
from dstrain.train.objectives.preference.losses import PairCounts, PairLogps
from dstrain.train.step.components import Component, Progress
from dstrain.train.step.forward import ModelForward
from dstrain.train.step.handle import RunHandle
from dstrain.train.step.steps import TrainStep


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
    """The reward metrics in the train and valid records, the reference's scores before step 1, and their key in the
    checkpoint."""

    state_key = "preference"

    def __init__(self, run: RunHandle, forward: PreferenceForward, reference: tuple[str, dict] | None) -> None:
        """``reference``: the key of the reference's scores and what it was made of (None for simpo)."""
        self.run, self.forward, self.reference = run, forward, reference

    @property
    def reference_key(self) -> str | None:
        return None if self.reference is None else self.reference[0]

    def on_train_start(self) -> None:
        if self.reference is not None:
            reference_pass(self.run, self.forward, *self.reference)

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
    """The metrics, with the key of the reference's scores (None for simpo); a component of the preference objective
    only (dstrain.train.objectives.preference.TRAINING)."""
    forward = run.forward
    assert isinstance(forward, PreferenceForward)  # the objective's own forward
    return PreferenceMetrics(run, forward, None if forward.preference.loss == "simpo" else reference_key(run))


def reference_key(run: RunHandle) -> tuple[str, dict]:
    """The key of the reference's (init_from's) scores of the run's pairs and its parts: rank 0 hashes the weights,
    once."""
    from dstrain.data.manifest import read_manifest
    from dstrain.train.objectives.preference.reference_scores import scores_key, weights_hash

    assert run.model_source is not None  # dstrain.objectives.preference.check refused a reference loss without it
    d = run.recipe.data
    key: list = [None]
    if run.is_rank0:
        weights = weights_hash(run.model_source.weights()[1])
        key[0] = scores_key(weights, read_manifest(d.sources[0].path).hash, d.seq_len, d.overlong)
    torch.distributed.broadcast_object_list(key, src=0)
    return key[0]


def reference_pass(run: RunHandle, forward: PreferenceForward, key: str, parts: dict) -> None:
    """Before step 1: the reference's scores of every pair set on ``forward``, kept or computed. A fresh run's engine
    holds init_from's weights: the policy at step 0 is the reference, and it scores the pairs under the run's own
    strategy (ZeRO 0-3, AutoTP, SP; no second model). A resumed run's engine holds no longer: its scores must be
    kept."""
    from dstrain.data.manifest import read_manifest
    from dstrain.train.objectives.preference.reference_scores import load_scores, reference_scores, score_pairs

    d = run.recipe.data
    folder = d.sources[0].path
    forward.reference_file = f"{folder}/reference_scores/{key}.npy"
    if run.progress.step > 0 and load_scores(folder, key) is None:
        raise DstrainError(
            f"{forward.reference_file}: the reference scores this run was trained against are gone; restore them, or "
            f"score them again with `dstrain eval {run.files.root} --data {folder} --reference {run.recipe.init_from}`"
        )

    def compute(partial: Path) -> np.ndarray:
        sets = [
            build_dataset([(folder, 1.0)], split, d.seq_len, run.recipe.seed, None, d.valid_fraction,
                          overlong=d.overlong)
            for split in ("train", "valid")
        ]  # fmt: skip
        ranks = [0] * run.world  # the data-parallel rank of each rank: one rank of each replica keeps its rows
        torch.distributed.all_gather_object(ranks, run.dp_rank)

        def scored(batch: dict) -> PairLogps:
            run.components.on_phase("reference", 0)  # each micro-batch a phase of its own: the hang watchdog's bound
            return forward.policy_logps(batch)

        run.engine.eval()
        try:
            return score_pairs(scored, sets, read_manifest(folder).documents // 2,
                               run.strategy.micro_batch, run.dp_rank, run.strategy.dp_size, run.device, partial,
                               adds=ranks.index(run.dp_rank) == run.rank)  # fmt: skip
        finally:
            run.engine.train()

    forward.reference = torch.from_numpy(reference_scores(folder, key, parts, compute))
