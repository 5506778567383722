"""`dstrain eval MODEL --data PAIRS --reference REF`: the preference loss and reward metrics of a model (a run or a
Hugging Face folder) over a pair folder's split (docs/preference-tuning.md).

The preference objective's evaluation (dstrain.train.objectives.training.ObjectiveTraining.evaluate), which
dstrain.commands.evaluate runs for a pair folder. The reference's scores of every pair come from
dstrain.train.objectives.preference.reference_scores (computed once, kept beside the shards, reused); the model's
from the same packed, document-masked forwards; the loss is ``--loss`` with ``--beta`` (PreferenceConfig's defaults
otherwise), the mean over the split's pairs. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from dstrain.errors import DstrainError
from dstrain.options import declared_default, given

DEFAULT_MICRO_BATCH = 4


def evaluate_pairs(args: argparse.Namespace) -> dict:
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.config import DataConfig, Recipe
    from dstrain.data.dataset import build_dataset
    from dstrain.data.manifest import read_manifest
    from dstrain.objectives.preference_config import PreferenceConfig
    from dstrain.train.objectives.preference.losses import PairLogps, metric_sums, metrics_of, pair_losses
    from dstrain.train.objectives.preference.reference_scores import (
        reference_scores,
        score_pairs,
        scores_key,
        weights_hash,
    )
    from dstrain.train.process import distributed

    preference = PreferenceConfig(
        loss=given(args.loss, declared_default(PreferenceConfig, "loss")),
        beta=given(args.beta, declared_default(PreferenceConfig, "beta")),
    )
    if args.reference is None and preference.loss != "simpo":
        raise DstrainError(
            f"--data {args.data} holds preference pairs: name the reference model with --reference DIR (the policy's "
            f"init_from), or pass --loss simpo (reference-free)"
        )
    manifest = read_manifest(args.data)
    config, state, recipe = load_model_source(args.model, args.tag)
    if manifest.vocab_size > config.vocab_size:
        raise DstrainError(
            f"--data {args.data} has {manifest.vocab_size} token ids, the model {args.model} only "
            f"{config.vocab_size}; pass data prepared with the model's tokenizer"
        )
    seq_len = given(args.seq_len, recipe and recipe.data.seq_len, config.max_seq_len)
    seed = given(args.seed, recipe and recipe.seed, declared_default(Recipe, "seed"))
    valid_fraction = given(
        args.valid_fraction, recipe and recipe.data.valid_fraction, declared_default(DataConfig, "valid_fraction")
    )
    overlong = recipe.data.overlong if recipe else declared_default(DataConfig, "overlong")
    # The reference scores every pair: at valid_fraction 0 the train split holds them all (an empty valid split is
    # refused by build_dataset, in one line, only where --split asks for it).
    splits = ("train", "valid") if valid_fraction > 0 or args.split == "valid" else ("train",)
    sets = {
        split: build_dataset([(args.data, 1.0)], split, seq_len, seed, None, valid_fraction, overlong=overlong)
        for split in splits
    }
    distributed.init()
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    micro, pairs = given(args.micro_batch, DEFAULT_MICRO_BATCH), manifest.documents // 2

    def scores_of(model_config, model_state, datasets, partial=None) -> np.ndarray:
        forward = _forward(dataclasses.replace(model_config, doc_masking=True), model_state, device)
        return score_pairs(forward, datasets, pairs, micro, rank, world, device, partial)

    policy = scores_of(config, state, [sets[args.split]])
    reference = np.zeros_like(policy)
    if args.reference is not None:
        ref_config, ref_state, _ = load_model_source(args.reference)
        key, parts = scores_key(weights_hash(ref_state), manifest.hash, seq_len, overlong)
        reference = reference_scores(
            args.data, key, parts, lambda partial: scores_of(ref_config, ref_state, list(sets.values()), partial)
        )
    met = ~np.isnan(policy[:, 0])
    if not met.any():
        raise DstrainError(f"--data {args.data}: the {args.split} split holds no pairs to evaluate")
    p, r = torch.from_numpy(policy[met]), torch.from_numpy(reference[met])
    logps = PairLogps(p[:, 0], p[:, 1], r[:, 0], r[:, 1], p[:, 2], p[:, 3])
    losses = pair_losses(preference, logps)
    return {
        "model": str(args.model), "split": args.split, "pairs": int(met.sum()), "loss_type": preference.loss,
        "beta": preference.beta, "loss": losses.mean().item(), **metrics_of(metric_sums(preference, logps), met.sum()),
    }  # fmt: skip


def _forward(config, state, device):
    """A plain model's PairLogps of a micro-batch."""
    from dstrain.model.gpt import GPT
    from dstrain.train.objectives.preference.losses import completion_logps

    model = GPT(config)
    model.load_state_dict(state, strict=True)
    model.to(device).eval()
    return lambda batch: completion_logps(
        model(batch["input_ids"], batch["position_ids"]), batch["labels"], batch["documents"]
    )
