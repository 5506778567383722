"""Packing whole conversations into samples (data prepared with ``dstrain prepare --chat``).

Text is packed Megatron-style: documents back to back, a sample every ``seq_len`` tokens, so a document may span two
samples. A conversation must not: its second part would be learned without its first. So each epoch's shuffled
conversations are packed in order, next-fit, as whole examples into samples of ``seq_len + 1`` tokens, the rest of
a sample padding (its own document under document masking, its labels ignored). A conversation longer than
``seq_len + 1`` tokens is cut to that length (``data.overlong: truncate``: the end of its last answer is not learned)
or left out (``drop``). Position ids restart at every conversation, so with document masking packing changes no
token's loss (tests/test_sft_training.py proves it).

Every epoch holds the first epoch's number of samples: an epoch that packs into more drops its last conversations,
one that packs into fewer ends with empty (all-padding) samples; both are a few samples at most.
"""

from __future__ import annotations

import numpy as np

OVERLONG = ("truncate", "drop")


def packs_whole(manifest: dict) -> bool:
    """Whether a prepared folder's documents are packed whole (--chat conversations): then every reader, training
    and every evaluation, reads them with document masking and positions restarting at each document."""
    return manifest.get("chat") is not None


def pack_epoch(sizes: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """First position in ``order`` of each sample, and the end: next-fit of whole documents (``sizes`` already cut to
    ``capacity``) into samples of ``capacity`` tokens."""
    starts = [0]
    used = 0
    # A plain loop: next-fit is sequential, and this runs once per epoch before the result is cached.
    for position, size in enumerate(sizes[order].tolist()):
        if used + size > capacity:
            starts.append(position)
            used = 0
        used += size
    starts.append(order.size)
    return np.asarray(starts if order.size else [0], dtype=np.int64)


def build_chat_epochs(
    sizes: np.ndarray, docs: np.ndarray, seq_len: int, seed: int, num_epochs: int, overlong: str
) -> dict[str, np.ndarray]:
    """doc_order and sample_starts (rows [first position in doc_order, 0]; sample k spans rows k to k+1 exclusive of
    the second's document) and sample_order of ``num_epochs`` epochs, each of the first epoch's sample count."""
    capacity = seq_len + 1
    if overlong == "drop":
        docs = docs[sizes[docs] <= capacity]
    cut = np.minimum(sizes, capacity)
    doc_orders, starts_list, orders = [], [], []
    count = None
    for epoch in range(num_epochs):
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(docs)
        starts = pack_epoch(cut, order, capacity)
        count = starts.size - 1 if count is None else count
        if starts.size - 1 > count:  # drop the conversations past the first epoch's sample count
            order, starts = order[: starts[count]], starts[: count + 1]
        starts = np.concatenate([starts, np.full(count + 1 - starts.size, order.size, dtype=np.int64)])
        doc_orders.append(order)
        starts_list.append(np.stack([starts, np.zeros_like(starts)], axis=1))
        orders.append(rng.permutation(count))
    return {
        "doc_order": np.concatenate(doc_orders),
        "sample_starts": np.concatenate(starts_list),
        "sample_order": np.concatenate(orders),
        "epoch_docs": np.asarray([o.size for o in doc_orders], dtype=np.int64),
    }


def chat_sample(pieces: list[np.ndarray], masks: list[np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One sample from whole conversations (each cut to ``seq_len + 1``): tokens, loss mask and position ids padded to
    ``seq_len + 1`` tokens."""
    capacity = seq_len + 1
    pieces = [p[:capacity] for p in pieces]
    masks = [m[:capacity] for m in masks]
    used = sum(p.size for p in pieces)
    if used < capacity:
        pieces.append(np.full(capacity - used, pad_id, dtype=np.int64))
        masks.append(np.zeros(capacity - used, dtype=np.uint8))
    lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
    positions = np.arange(capacity, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return {
        "tokens": np.concatenate(pieces, dtype=np.int64, casting="safe"),
        "loss_mask": np.concatenate(masks),
        "position_ids": positions[:seq_len],
    }
