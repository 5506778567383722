"""Megatron's MMIDIDX v1 indexed dataset: one ``.bin`` of token ids + one ``.idx`` index.

Layout (little-endian), as Megatron-LM's ``indexed_dataset.py`` reads it::

    .bin  token ids of every sequence, back to back, in the index's dtype
    .idx  b"MMIDIDX\\x00\\x00"           magic (9 bytes)
          uint64 1                     version
          uint8  dtype code            1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                       6 float64, 7 float32, 8 uint16
          uint64 num_sequences
          uint64 num_documents + 1     length of doc_idx
          int32  sizes[num_sequences]      tokens per sequence (EOS included)
          int64  pointers[num_sequences]   byte offset of each sequence in .bin
          int64  doc_idx[num_documents+1]  first sequence of each document

One sequence is one document here, so doc_idx is 0..n. Files are written under a
temporary name and renamed when complete (``.bin`` first, ``.idx`` last), so a
shard whose ``.idx`` exists is whole.

Data prepared with ``--chat`` has a companion indexed dataset per shard, ``PREFIX.mask.bin/.idx``: the same
documents, one uint8 per token, 1 where the token is learned (dstrain.data.chat). It is published before the
shard's own ``.idx``, so a shard whose ``.idx`` exists has its whole mask too.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dstrain.errors import DstrainError

SHARD_NAME = "shard_{:05d}"  # a prepared folder's k-th shard, OUT/shard_00000.bin/.idx, ...
MASK_SUFFIX = ".mask"  # a shard's loss mask (--chat): OUT/shard_00000.mask.bin/.idx
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, num sequences, len(doc_idx)
# Megatron's own rule: token ids fit uint16 below this vocabulary size.
UINT16_VOCAB_LIMIT = 65_500


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest Megatron dtype for ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def shard_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(``PREFIX.bin``, ``PREFIX.idx``)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def mask_prefix(prefix: str | os.PathLike) -> str:
    """The prefix of a shard's loss-mask companion."""
    return str(prefix) + MASK_SUFFIX


def write_index(path: str | os.PathLike, sizes: np.ndarray, dtype: np.dtype) -> None:
    """Write the ``.idx`` of documents with these ``sizes`` stored back to back as ``dtype``."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes)
    pointers = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], sizes.size, doc_idx.size))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class ShardWriter:
    """Streams documents into ``PREFIX.bin``; ``finish()`` writes the index and publishes both.

    Memory holds only the per-document sizes, never the token ids. ``masked``: a loss mask is written beside.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype, masked: bool = False):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.bin_path, self.idx_path = shard_paths(prefix)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[np.ndarray] = []
        self.documents = 0
        self.tokens = 0
        self.mask = ShardWriter(mask_prefix(prefix), np.dtype(np.uint8)) if masked else None

    def add(self, token_ids: np.ndarray, sizes: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents: ``token_ids`` is their ids back to back, ``sizes`` their lengths, ``mask`` their
        loss mask (a masked writer only)."""
        if (mask is None) != (self.mask is None):
            raise ValueError("a masked shard takes a mask with every document, an unmasked one none")
        if self.mask is not None and mask is not None:
            self.mask.add(mask, sizes)
        token_ids = np.ascontiguousarray(token_ids, dtype=self.dtype)
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != token_ids.size:
            raise ValueError(f"sizes sum to {int(sizes.sum())} but {token_ids.size} ids were given")
        self._bin.write(token_ids.tobytes())
        self._sizes.append(sizes.astype(np.int32))
        self.documents += sizes.size
        self.tokens += token_ids.size

    def finish(self) -> tuple[int, int]:
        """Write the index, rename both files into place; returns (documents, tokens)."""
        if self.mask is not None:
            self.mask.finish()
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        write_index(self._idx_tmp, sizes, self.dtype)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        return self.documents, self.tokens

    def abort(self) -> None:
        """Drop the partial files (an interrupted write leaves only ``*.tmp`` behind)."""
        if self.mask is not None:
            self.mask.abort()
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)


@dataclass
class ShardReader:
    """Memory-mapped view of one shard: ``tokens`` (all ids), ``sizes``, ``pointers``, ``doc_idx``."""

    prefix: str
    tokens: np.ndarray
    sizes: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray

    @classmethod
    def open(cls, prefix: str | os.PathLike) -> ShardReader:
        bin_path, idx_path = shard_paths(prefix)
        rerun = "re-run `dstrain prepare` with the same options to rebuild it"
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DstrainError(f"{path}: shard file is missing; {rerun}")
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        if idx.size < _HEADER.size:
            raise DstrainError(f"{idx_path}: index is truncated ({idx.size} bytes); {rerun}")
        magic, version, code, count, doc_count = _HEADER.unpack(idx[: _HEADER.size].tobytes())
        if magic != MAGIC:
            raise DstrainError(f"{idx_path}: not a Megatron MMIDIDX index (magic {magic!r}); {rerun}")
        if version != VERSION:
            raise DstrainError(f"{idx_path}: MMIDIDX version {version}, only version 1 is read; {rerun}")
        if code not in DTYPE_CODES:
            raise DstrainError(f"{idx_path}: unknown dtype code {code}; {rerun}")
        expected = _HEADER.size + 4 * count + 8 * count + 8 * doc_count
        if idx.size != expected:
            raise DstrainError(f"{idx_path}: index holds {idx.size} bytes, its header implies {expected}; {rerun}")
        offset = _HEADER.size
        sizes = np.frombuffer(idx, dtype="<i4", count=count, offset=offset)
        pointers = np.frombuffer(idx, dtype="<i8", count=count, offset=offset + 4 * count)
        doc_idx = np.frombuffer(idx, dtype="<i8", count=doc_count, offset=offset + 12 * count)
        dtype = np.dtype(DTYPE_CODES[code])
        expected_bin = int(pointers[-1]) + int(sizes[-1]) * dtype.itemsize if count else 0
        actual_bin = bin_path.stat().st_size
        if actual_bin != expected_bin:
            raise DstrainError(
                f"{bin_path}: holds {actual_bin} bytes but its index expects {expected_bin} "
                f"(truncated or overwritten); {rerun}"
            )
        # A plain ndarray view: slicing an np.memmap subclass is several times slower.
        tokens = np.memmap(bin_path, dtype=dtype, mode="r").view(np.ndarray) if actual_bin else np.zeros(0, dtype)
        return cls(str(prefix), tokens, sizes, pointers, doc_idx)

    def __len__(self) -> int:
        return self.sizes.size

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.tokens.itemsize
        return self.tokens[start : start + int(self.sizes[i])]
