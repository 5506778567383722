"""Packing preference pairs whole (a folder of dstrain.data.pairs: documents 2k and 2k + 1 are pair k's chosen and
rejected answers).

The packing unit is the pair, not the document: pairs are split into train and valid, shuffled and packed next-fit
(dstrain.data.chat_packing) as one piece of chosen + rejected tokens, so both sides of a pair are always in one
sample, neighbours, chosen first. A pair longer than ``seq_len + 1`` is cut (``data.overlong: truncate``: the longer
side loses the end of its completion, neither below half the sample where both need it) or left out (``drop``).
Each sample carries ``documents``: every token's piece in the sample (0, 1 the first pair's chosen and rejected, 2, 3
the next pair's, ..., -1 padding), which the completion log-prob sums are taken by
(dstrain.train.objectives.preference.losses).
"""

from __future__ import annotations

import numpy as np

from dstrain.data.chat_packing import chat_sample


def pair_sizes(document_sizes: np.ndarray) -> np.ndarray:
    """Each pair's tokens (chosen + rejected) from its documents' sizes."""
    sizes = document_sizes.astype(np.int64)
    return sizes[0::2] + sizes[1::2]


def pair_cut(chosen: int, rejected: int, capacity: int) -> tuple[int, int]:
    """(chosen, rejected) tokens kept of a pair in a sample of ``capacity`` tokens: both whole where they fit, else
    the longer side cut first, neither below ``capacity // 2`` where both need as much."""
    if chosen + rejected <= capacity:
        return chosen, rejected
    half = capacity // 2
    kept_chosen = min(chosen, max(half, capacity - rejected))
    return kept_chosen, min(rejected, capacity - kept_chosen)


def pair_sample(sides: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One sample of whole pairs: ``sides`` is [(ids, mask) of a pair's chosen, (ids, mask) of its rejected, ...];
    chat_sample's tokens, loss mask and position ids, and each token's piece (``documents``, -1 for padding)."""
    pieces, masks = [], []
    for (chosen, chosen_mask), (rejected, rejected_mask) in zip(sides[0::2], sides[1::2]):
        a, b = pair_cut(chosen.size, rejected.size, seq_len + 1)
        pieces += [chosen[:a], rejected[:b]]
        masks += [chosen_mask[:a], rejected_mask[:b]]
    sample = chat_sample(pieces, masks, seq_len, pad_id)
    lengths = [p.size for p in pieces]
    documents = np.full(seq_len + 1, -1, dtype=np.int64)
    documents[: sum(lengths)] = np.repeat(np.arange(len(pieces)), lengths)
    return {**sample, "documents": documents}
