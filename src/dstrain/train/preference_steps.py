"""The trainer's preference step (a recipe's ``preference:``, docs/preference-tuning.md): StepRunner with the
preference loss in place of the LM loss, and the component that scores the reference before step 1 and puts the
reward metrics in the train and valid records.

The step's loss is the mean over the global batch's pairs (and the RPO term the mean over its chosen tokens), as the
SFT step's is over its learned tokens (dstrain.train.steps): one all-reduce before the step's forwards counts the
pairs and chosen tokens of every rank's micro-batches; each micro-batch's share (dstrain.train.preference.loss_share)
is multiplied by dp x accumulation, which DeepSpeed's backward and data-parallel average divide out again.

The reference's scores (dstrain.train.reference_scores) come from a plain model loaded from init_from on every rank,
each scoring a share of the pairs, kept beside the shards and reused by every later run (and resume) on the same
weights, data and packing; the key is kept in the checkpoint, and a resume whose init_from or data gives another key
is refused in one line. Sequence and pipeline parallelism are refused in one line (each needs its own gather of the
completions' log-probs); a chunked loss (ds_config tiling.loss) is computed whole here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dstrain.errors import DstrainError
from dstrain.train.components import Component, Progress
from dstrain.train.preference import METRICS, PairCounts, PairLogps, completion_logps, loss_share, metric_sums
from dstrain.train.steps import StepRunner


class PreferenceSteps(StepRunner):
    """StepRunner whose micro-batch loss is the preference loss's share (module doc)."""

    def __init__(self, recipe, strategy, engine, progress: Progress, hooks, components: Component) -> None:
        super().__init__(recipe, strategy, engine, progress, hooks, components)
        if self.sp_size > 1 or self.pipeline:
            raise DstrainError(
                f"preference: is not available under {'sequence' if self.sp_size > 1 else 'pipeline'} parallelism "
                f"(docs/preference-tuning.md); use a ZeRO or AutoTP ds_config"
            )
        self.preference = recipe.preference
        self.reference: torch.Tensor | None = None  # (pairs, 4) float64, set by reference_pass before step 1
        self.reference_file = ""  # where they are kept
        self.counts: PairCounts | None = None  # during a train step: the global batch's pairs and chosen tokens
        # per split, since its last record: METRICS' sums over this rank's pairs, and their count
        self.sums = {split: torch.zeros(len(METRICS) + 1, dtype=torch.float64) for split in ("train", "valid")}
        self.last_eval: torch.Tensor | None = None  # the last evaluation micro-batch's metric sums and pairs

    def _count_learned(self, micro_batches: list[dict]) -> None:
        local = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in micro_batches:
            learned = batch["labels"] != -100
            chosen = learned & (batch["documents"] >= 0) & (batch["documents"] % 2 == 0)
            local += torch.stack([(batch["pair_ids"] >= 0).sum(), chosen.sum(), learned.sum()]).double()
        self.components.on_mark("counting the step's pairs")
        torch.distributed.all_reduce(local)
        pairs, chosen, learned = (v * self.strategy.dp_size / self.world for v in local.tolist())
        self.counts, self.learned_tokens = PairCounts(pairs, chosen), round(learned)
        self._set_divisor(1.0)  # marks a train step (the shares carry their own divisors)

    def train_step(self, batches) -> torch.Tensor:
        try:
            return super().train_step(batches)
        finally:
            self.counts = None

    def _forward_loss(self, batch: dict) -> torch.Tensor:
        logits = self.engine(batch["input_ids"], batch["position_ids"])
        logps = self.pair_logps(logits, batch)
        sums = torch.cat([metric_sums(self.preference, logps).cpu(), torch.tensor([float(logps.chosen.numel())])])
        if self.counts is not None:
            self.sums["train"] += sums
            scale = self.strategy.dp_size * self.strategy.grad_accum
            return loss_share(self.preference, logps, self.counts) * scale
        self.last_eval = sums
        own = PairCounts(float(logps.chosen.numel()), float(logps.chosen_tokens.sum()))
        return loss_share(self.preference, logps, own)  # the mean over this micro-batch's pairs

    def pair_logps(self, logits: torch.Tensor, batch: dict) -> PairLogps:
        """The policy's log-prob sums of the batch's pairs, with the reference's from the kept scores."""
        logps = completion_logps(logits, batch["labels"], batch["documents"])
        if self.reference is None:  # simpo: no reference
            return logps
        pairs = batch["pair_ids"][batch["pair_ids"] >= 0].cpu()
        ref = self.reference[pairs]
        if torch.isnan(ref[:, :2]).any():
            raise DstrainError(
                f"{self.reference_file}: no reference score for pair {int(pairs[torch.isnan(ref[:, 0])][0])}; "
                f"delete it and its .json to score the pairs again"
            )
        ref = ref.to(logits.device, logps.chosen.dtype)
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


class PreferenceMetrics(Component):
    """The reward metrics in the train and valid records, and the reference's key in the checkpoint."""

    state_key = "preference"

    def __init__(self, steps: PreferenceSteps, reference_key: str | None) -> None:
        self.steps, self.reference_key = steps, reference_key

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "eval":
            self.steps.sums["valid"].zero_()

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return self.steps.metrics("train")

    def valid_record_fields(self) -> dict:
        return self.steps.metrics("valid")

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


def reference_pass(trainer) -> str | None:
    """Before step 1: the reference's (init_from's) scores of every pair, kept or computed, set on the trainer's
    steps; their key (None for simpo)."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.data.dataset import build_dataset
    from dstrain.data.manifest import manifest_hash, read_manifest
    from dstrain.model.gpt import GPT
    from dstrain.train.reference_scores import reference_scores, score_pairs, scores_key, weights_hash

    recipe, steps = trainer.recipe, trainer.steps
    if recipe.preference.loss == "simpo":
        return None
    d = recipe.data
    folder = d.sources[0].path
    manifest = read_manifest(folder)
    config, state, _ = load_model_source(recipe.init_from)
    key, parts = scores_key(weights_hash(state), manifest_hash(manifest), d.seq_len, d.overlong)

    def compute() -> np.ndarray:
        model = GPT(dataclasses.replace(config, doc_masking=True))
        model.load_state_dict(state, strict=True)
        model.to(trainer.device).eval()
        sets = [
            build_dataset([(folder, 1.0)], split, d.seq_len, recipe.seed, None, d.valid_fraction, overlong=d.overlong)
            for split in ("train", "valid")
        ]
        forward = lambda batch: model(batch["input_ids"], batch["position_ids"])  # noqa: E731
        # every rank a share of its own (a plain model: no collective in its forwards), one all-reduce adds them
        return score_pairs(forward, sets, int(manifest["documents"]) // 2, trainer.strategy.micro_batch,
                           trainer.rank, trainer.world, trainer.device)  # fmt: skip

    steps.reference = torch.from_numpy(reference_scores(folder, key, parts, compute))
    steps.reference_file = f"{folder}/reference_scores/{key}.npy"
    return key
