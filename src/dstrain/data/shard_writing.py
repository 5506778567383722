"""Writing a prepared folder's shards from an encoder's output, resumably (the core of ``dstrain prepare``).

An encoder (``ParallelEncoder`` for text, ``ChatEncoder`` for conversations) has ``masked`` (whether it makes a loss
mask) and ``read(source, start)``, which yields (ids back to back, sizes, mask back to back or None) per batch of
documents from document ``start`` on. Shard k starts where shard k-1 ends and closes before the first document that
would overflow it; a complete shard an interrupted run left is kept.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from dstrain.data.shards import SHARD_NAME, ShardReader, ShardWriter, mask_prefix, shard_paths
from dstrain.data.sources import Source
from dstrain.errors import DstrainError


def complete_shard(out: Path, index: int, masked: bool = False) -> ShardReader | None:
    """Shard ``index`` if it was fully written and is intact (its loss mask too, if ``masked``), else None (it will be
    rewritten)."""
    prefix = out / SHARD_NAME.format(index)
    if not shard_paths(prefix)[1].is_file():
        return None
    try:
        shard = ShardReader.open(prefix)
        if masked and not np.array_equal(ShardReader.open(mask_prefix(prefix)).sizes, shard.sizes):
            return None
        return shard
    except DstrainError:
        return None


def shard_record(index: int, documents: int, tokens: int) -> dict:
    return {"prefix": SHARD_NAME.format(index), "documents": int(documents), "tokens": int(tokens)}


class Progress:
    """tqdm bar over documents, with tokens/s (throttled on non-terminals, e.g. Slurm logs)."""

    def __init__(self, total: int | None, enabled: bool):
        from tqdm import tqdm

        interactive = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            unit="doc",
            disable=not enabled,
            mininterval=0.5 if interactive else 30,
            desc="prepare",
            dynamic_ncols=True,
        )
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, documents: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        self.bar.update(documents)


def _write_segment(
    out: Path,
    index: int,
    doc: int,
    source: Source,
    encoder,
    dtype: np.dtype,
    shard_tokens: int,
    progress: Progress,
) -> tuple[list[dict], int, bool]:
    """Write shards ``index, index+1, ...`` from document ``doc`` until the data ends or the
    next shard already exists. Returns (shard records, next document, data exhausted)."""
    written: list[dict] = []
    writer: ShardWriter | None = None
    try:
        for ids, sizes, mask in encoder.read(source, doc):
            ends = np.cumsum(sizes)
            i = 0
            while i < sizes.size:
                if writer is None:
                    writer = ShardWriter(out / SHARD_NAME.format(index), dtype, encoder.masked)
                base = int(ends[i - 1]) if i else 0
                fit = int(np.searchsorted(ends[i:] - base, shard_tokens - writer.tokens, side="right"))
                if fit == 0 and writer.documents == 0:
                    fit = 1  # a document longer than a whole shard gets a shard of its own
                if fit:
                    span = slice(base, int(ends[i + fit - 1]))
                    writer.add(ids[span], sizes[i : i + fit], None if mask is None else mask[span])
                    progress.update(fit, int(ends[i + fit - 1]) - base)
                    i, doc = i + fit, doc + fit
                if i < sizes.size:  # the next document does not fit: this shard is complete
                    written.append(shard_record(index, *writer.finish()))
                    writer, index = None, index + 1
                    following = complete_shard(out, index, encoder.masked)
                    if following is not None:
                        overlap = min(len(following), sizes.size - i)
                        if not np.array_equal(following.sizes[:overlap], sizes[i : i + overlap]):
                            raise DstrainError(
                                f"{following.prefix}.idx does not continue the shard before it; "
                                f"choose another --out (its shards do not match these inputs)"
                            )
                        return written, doc, False
        if writer is not None:
            written.append(shard_record(index, *writer.finish()))
            writer = None
        return written, doc, True
    finally:
        if writer is not None:
            writer.abort()


def write_shards(
    out: Path, source: Source, encoder, dtype: np.dtype, shard_tokens: int, progress: Progress
) -> list[dict]:
    shards: list[dict] = []
    index = doc = 0
    with encoder:
        while True:
            existing = complete_shard(out, index, encoder.masked)
            if existing is not None:  # written by an earlier, interrupted run
                tokens = int(existing.sizes.sum(dtype=np.int64))
                shards.append(shard_record(index, len(existing), tokens))
                progress.update(len(existing), 0)
                index, doc = index + 1, doc + len(existing)
                continue
            if source.num_docs is not None and doc >= source.num_docs:
                return shards
            written, doc, exhausted = _write_segment(out, index, doc, source, encoder, dtype, shard_tokens, progress)
            shards += written
            index += len(written)
            if exhausted:
                return shards


LENGTH_BOUNDS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def chat_counts(out: Path, prefixes: list[str]) -> dict:
    """The learned tokens (mask ones), the longest example, and how many examples exceed each common seq_len
    (packing truncates or drops them by the recipe's data.overlong)."""
    learned, sizes = 0, []
    for prefix in prefixes:
        learned += int(ShardReader.open(mask_prefix(out / prefix)).tokens.sum(dtype=np.int64))
        sizes.append(ShardReader.open(out / prefix).sizes)
    lengths = np.concatenate(sizes) if sizes else np.zeros(0, np.int32)
    return {
        "learned_tokens": learned,
        "longest": int(lengths.max()) if lengths.size else 0,
        "longer_than": {str(n): int((lengths > n).sum()) for n in LENGTH_BOUNDS},
    }
