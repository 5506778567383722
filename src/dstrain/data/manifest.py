"""``manifest.json``: what a prepared folder holds, written last by ``dstrain prepare``.

Its presence means every shard it lists is complete. Keys::

    format, format_version     "dstrain-packed-shards", 1
    tokenizer                  {"name", "path" (relative), "hash", "trained_vocab_size"}
    vocab_size, eos_id, dtype  len(tokenizer), the EOS id ending every document, token dtype
    framing                    {"bos_id", "eos_id"}: BOS starting each document where the tokenizer puts one
                               (Llama 3), else null; EOS ending each (dstrain.data.tokenizer.document_framing)
    shards                     [{"prefix", "documents", "tokens"}, ...] in document order
    documents, tokens          totals
    shard_tokens               the --shard-tokens bound the shards were cut with
    source                     {"dataset", "config", "split", "text_field", "fingerprint"}
    command                    the equivalent `dstrain prepare ...` command line
    chat                       --chat only, else null: {"format", "template_hash", "template_file", "mask_from",
                               "learned_tokens", "longest", "longer_than": {seq_len: examples}}; each shard then
                               has a loss mask, PREFIX.mask.bin/.idx (dstrain.data.shards), recorded as mask_*
    task                       only in a task's folder before the merge: {"index", "count", and
                               "files": [a, b] + "file_digests", or "rows": [a, b]} (data/prepare_parts.py)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dstrain.errors import DstrainError

MANIFEST_NAME = "manifest.json"
INPUTS_NAME = "prepare_inputs.json"  # what a folder is being made from, written first (checked on re-runs)
FORMAT = "dstrain-packed-shards"
FORMAT_VERSION = 1


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared folder; a one-line DstrainError if there is none."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        where = "" if Path(folder).is_absolute() else f" (relative to the working directory: {path.resolve()})"
        raise DstrainError(
            f"{path}: no manifest{where}, so {folder} holds no prepared data; name the folder `dstrain prepare` "
            f"wrote (moved data: its new path), or run `dstrain prepare --out {folder} ...` first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DstrainError(
            f"{path}: unreadable manifest ({e}); re-run `dstrain prepare` with the same options"
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise DstrainError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}; re-run `dstrain prepare` into a new --out"
        )
    return manifest


def manifest_hash(manifest: dict[str, Any]) -> str:
    """Hash of what the data is (not of how the command was spelled): keys the index cache."""
    content = {k: v for k, v in manifest.items() if k != "command"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


# --- the shards as prepared: sizes always, sampled content hashes where the manifest has them ----------------------
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 1 << 16  # at most 1 MiB read per file at each start


def sampled_hash(path: Path) -> str:
    """XXH3-64 of the file's size and of 16 blocks of 64 KiB spread evenly over it (the whole file up to 1 MiB):
    a bounded read at every start that still tells a replaced shard from the prepared one."""
    import xxhash

    size = path.stat().st_size
    digest = xxhash.xxh3_64(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLE_BLOCKS - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _shard_file_kinds(prefix: Path, masked: bool) -> list[tuple[str, Path]]:
    """(record key's prefix, path) of each file of a shard: its .bin and .idx, and its mask's where ``masked``."""
    kinds = [(ext, Path(f"{prefix}.{ext}")) for ext in ("bin", "idx")]
    return kinds + [(f"mask_{ext}", Path(f"{prefix}.mask.{ext}")) for ext in ("bin", "idx")] * masked


def shard_files(prefix: Path) -> dict[str, Any]:
    """What the manifest records of a shard's files (its loss mask's too, where it has one), for ``check_shards``."""
    record: dict[str, Any] = {}
    for key, path in _shard_file_kinds(prefix, Path(f"{prefix}.mask.idx").is_file()):
        record[f"{key}_bytes"] = path.stat().st_size
        record[f"{key}_sampled_xxh3"] = sampled_hash(path)
    return record


def check_shards(folder: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Every shard the manifest lists is there, of its size (recorded, or implied by its tokens and documents for a
    manifest without sizes), with its sampled content hash where recorded: else one line naming the file. Reads at
    most 2 MiB per shard."""
    import numpy as np

    from dstrain.data.shards import _HEADER

    itemsize = np.dtype(manifest["dtype"]).itemsize
    fix = "the data changed since it was prepared; restore it, or run `dstrain prepare` again into a new --out"
    for shard in manifest["shards"]:
        n = shard["documents"]
        index_bytes = _HEADER.size + 4 * n + 8 * n + 8 * (n + 1)
        implied = {"bin": shard["tokens"] * itemsize, "idx": index_bytes, "mask_bin": shard["tokens"]}
        implied["mask_idx"] = index_bytes
        masked = manifest.get("chat") is not None
        for ext, path in _shard_file_kinds(Path(folder) / shard["prefix"], masked):
            if not path.is_file():
                raise DstrainError(f"{path}: missing, though {Path(folder) / MANIFEST_NAME} lists it; {fix}")
            size, expected = path.stat().st_size, shard.get(f"{ext}_bytes", implied[ext])
            if size != expected:
                raise DstrainError(f"{path}: {size} bytes, its manifest says {expected}; {fix}")
            recorded = shard.get(f"{ext}_sampled_xxh3")
            if recorded is not None and sampled_hash(path) != recorded:
                raise DstrainError(f"{path}: its content differs from what its manifest recorded (same size); {fix}")
