"""The weight average a checkpoint holds (``averaged_weights.rank<r>.pt``, written by
dstrain.train.features.averaging), read
back as the plain GPT's fp32 state dict: what ``dstrain export --averaged`` writes.

Each rank's file holds its own slices: rank 0's is the whole model under ZeRO-0/1/2; the ranks' ZeRO-3 partitions
are laid end to end in rank order (DeepSpeed pads each flat parameter to a multiple of the ranks and gives rank r the
r-th piece); a pipeline's stages hold their layers, named as in the layer files (dstrain.model.pipe.layer_prefixes).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from dstrain.checkpoint import safe_load
from dstrain.checkpoint.consolidate import pipeline_to_plain
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig

FILE = "averaged_weights.rank{}.pt"
RANK = re.compile(r"^averaged_weights\.rank(\d+)\.pt$")
KINDS = ("ema", "last_n")


def window_mean(states: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Sum in the order given (oldest first), then one division: the same bits from the same states."""
    total = [t.clone() for t in states[0]]
    for state in states[1:]:
        torch._foreach_add_(total, state)
    torch._foreach_div_(total, float(len(states)))
    return total


def rank_files(tag_dir: Path) -> list[Path]:
    """The tag's weight-average files, in rank order."""
    found = {int(m.group(1)): p for p in tag_dir.iterdir() if (m := RANK.match(p.name))} if tag_dir.is_dir() else {}
    return [found[r] for r in sorted(found)]


def kinds_in(state: dict) -> list[str]:
    return [k for k in KINDS if (state["ema"] is not None if k == "ema" else bool(state["window"]))]


def average_of(state: dict, kind: str) -> list[torch.Tensor]:
    return state["ema"] if kind == "ema" else window_mean(state["window"])


def averaged_state_dict(tag_dir: Path, config: GPTConfig, kind: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """({GPT(config) parameter name: fp32 average}, the kind read). ``kind`` None: the one the checkpoint holds."""
    files = rank_files(tag_dir)
    if not files:
        raise DstrainError(
            f"{tag_dir} holds no weight average (train.averaging was off when it was saved); export without --averaged"
        )
    states = [safe_load.load(path) for path in files]
    kinds = kinds_in(states[0])
    if kind is None and len(kinds) == 1:
        kind = kinds[0]
    if not kinds:
        raise DstrainError(f"{tag_dir}: saved before train.averaging.start_step, no average yet; pass a later --tag")
    if kind not in kinds:
        raise DstrainError(f"{tag_dir}: holds the averages {', '.join(kinds)}; pass --averaged with one of them")
    layout = states[0]["layout"]
    if layout["tp_size"] > 1 or layout["ep_size"] > 1:
        raise DstrainError(
            f"{tag_dir}: its weight average is split over tensor- or expert-parallel ranks, which export --averaged "
            f"does not join; train the averaged run without tp/ep"
        )
    if layout["partitioned"]:
        return joined_partitions(states, kind), kind
    if layout["pp_stages"] > 1:
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for state in states:  # the first stage's copy of a tied module comes first and is the whole one
            for (index, own), tensor in zip(state["layer_keys"], average_of(state, kind)):
                layers.setdefault(index, {}).setdefault(own, tensor)
        return pipeline_to_plain(layers, config), kind
    return dict(zip(states[0]["names"], average_of(states[0], kind))), kind


def joined_partitions(states: list[dict], kind: str) -> dict[str, torch.Tensor]:
    averages = [average_of(state, kind) for state in states]
    whole = {}
    for i, (name, shape) in enumerate(zip(states[0]["names"], states[0]["shapes"])):
        flat = torch.cat([average[i].reshape(-1) for average in averages])
        whole[name] = flat[: math.prod(shape)].view(shape).clone()
    return whole
