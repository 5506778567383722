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

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstrain.errors import DstrainError
from dstrain.files import write_json_atomic

MANIFEST_NAME = "manifest.json"
INPUTS_NAME = "prepare_inputs.json"  # what a folder is being made from, written first (checked on re-runs)
FORMAT = "dstrain-packed-shards"
FORMAT_VERSION = 1


# --- the manifest as typed records: every key required (the writer always writes them), read once per source -------


@dataclass(frozen=True)
class TokenizerRecord:
    name: str  # --tokenizer as given, or what --train-tokenizer trained on
    path: str  # the tokenizer's folder, relative to the prepared folder
    hash: str  # dstrain.data.tokenizer.tokenizer_hash: equal vocabulary sizes are no proof, hashes are
    trained_vocab_size: int | None  # --train-tokenizer's size, None for a loaded tokenizer


@dataclass(frozen=True)
class Framing:
    bos_id: int | None  # starts each document where the tokenizer puts a BOS (Llama 3), else None
    eos_id: int  # ends each document


@dataclass(frozen=True)
class SourceRecord:
    dataset: str  # a Hub name, or an absolute path
    config: str | None
    split: str
    text_field: str
    fingerprint: str | None  # the content's; None only in a task's folder, whose merge sets it


@dataclass(frozen=True)
class ShardRecord:
    prefix: str  # PREFIX.bin/.idx in the prepared folder
    documents: int
    tokens: int
    bin_bytes: int  # each file's size and sampled content hash (check_shards)
    bin_sampled_xxh3: str
    idx_bytes: int
    idx_sampled_xxh3: str
    mask_bin_bytes: int | None = None  # the loss mask's files: a --chat folder's only
    mask_bin_sampled_xxh3: str | None = None
    mask_idx_bytes: int | None = None
    mask_idx_sampled_xxh3: str | None = None


@dataclass(frozen=True)
class ChatRecord:
    """What --chat rendered the conversations with, and what the loss mask learns."""

    format: str  # "messages" or "prompt-completion"
    template_hash: str
    template_file: str | None  # --chat-template, None for the tokenizer's own
    mask_from: str  # "generation markers", or prefix renders
    learned_tokens: int  # the mask's ones
    longest: int  # the longest example's tokens
    longer_than: dict[str, int]  # {seq_len: examples longer}, for the common seq_lens


@dataclass(frozen=True)
class PairsRecord:
    """A folder of preference pairs (dstrain.data.pairs): documents 2k and 2k + 1 are pair k's chosen and rejected."""

    pairs: int
    longest: int  # the longest pair's tokens, chosen + rejected (packed together)
    longer_than: dict[str, int]  # {seq_len: pairs longer than seq_len + 1}, for the common seq_lens


@dataclass(frozen=True)
class TaskRecord:
    """A task's part of a prepare split into N tasks (data/prepare_parts.py), in its folder before the merge."""

    index: int
    count: int
    files: list[int] | None = None  # [a, b): the input files of this task, with their content hashes
    file_digests: list[str] | None = None
    rows: list[int] | None = None  # [a, b): the rows of this task (one input file)


@dataclass(frozen=True)
class Manifest:
    """manifest.json, typed. Record types for other kinds of prepared data (preference pairs) sit beside ``chat``:
    an optional record, None where the folder holds another kind."""

    format: str
    format_version: int
    tokenizer: TokenizerRecord
    vocab_size: int
    eos_id: int
    framing: Framing
    dtype: str
    shards: list[ShardRecord]
    documents: int
    tokens: int
    shard_tokens: int
    source: SourceRecord
    command: str
    chat: ChatRecord | None = None
    pairs: PairsRecord | None = None  # a preference folder's (its chat record is set too)
    task: TaskRecord | None = None
    hash: str = field(default="", compare=False)  # manifest_hash of the file as written: keys caches, checkpoints

    @property
    def masked(self) -> bool:
        """Each shard has a loss mask (prepared with --chat)."""
        return self.chat is not None

    @property
    def kind(self) -> str:
        """What the folder holds: "pairs" (preference pairs), "chat" (conversations with a loss mask) or "text" (the
        kinds of data an objective trains on: dstrain.objectives.objective.DATA_KINDS)."""
        return "pairs" if self.pairs is not None else "chat" if self.chat is not None else "text"

    def to_dict(self) -> dict[str, Any]:
        """The JSON the writer writes (None records left out, as the writer leaves them out)."""
        raw = dataclasses.asdict(self)
        del raw["hash"]
        for key in ("chat", "pairs", "task"):
            if raw[key] is None:
                del raw[key]
        for shard in raw["shards"]:
            for key in [k for k, v in shard.items() if v is None]:
                del shard[key]
        return raw


def parse_manifest(raw: Any, path: Path) -> Manifest:
    """A manifest's JSON as a ``Manifest``, every key checked; else one line naming the file and the key."""
    from dstrain.typed_yaml import parse

    if not isinstance(raw, dict):
        raise DstrainError(f"{path}: not a manifest (a JSON object); re-run `dstrain prepare` into a new --out")
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise DstrainError(
            f"{path}: format {raw.get('format')!r} v{raw.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}; re-run `dstrain prepare` into a new --out"
        )
    try:
        manifest = parse(Manifest, {k: v for k, v in raw.items() if k != "hash"}, path, "")
    except DstrainError as e:
        raise DstrainError(
            f"{e}; this is not a manifest `dstrain prepare` writes: re-run it into a new --out"
        ) from None
    return dataclasses.replace(manifest, hash=manifest_hash(raw))


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of a prepared folder, strictly typed; a one-line DstrainError if there is none."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        where = "" if Path(folder).is_absolute() else f" (relative to the working directory: {path.resolve()})"
        raise DstrainError(
            f"{path}: no manifest{where}, so {folder} holds no prepared data; name the folder `dstrain prepare` "
            f"wrote (moved data: its new path), or run `dstrain prepare --out {folder} ...` first"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DstrainError(
            f"{path}: unreadable manifest ({e}); re-run `dstrain prepare` with the same options"
        ) from None
    return parse_manifest(raw, path)


def write_manifest(folder: Path, manifest: Manifest) -> Manifest:
    """Write a prepare's manifest (last: its presence means every shard is whole), checked as a reader reads it;
    returns it as read back (its ``hash`` set)."""
    raw = manifest.to_dict()
    written = parse_manifest(raw, folder / MANIFEST_NAME)  # every value of the type a reader takes
    write_json_atomic(folder / MANIFEST_NAME, raw)
    return written


def manifest_hash(manifest: dict[str, Any]) -> str:
    """Hash of what the data is (not of how the command was spelled): keys the index cache."""
    content = {k: v for k, v in manifest.items() if k != "command"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def same_tokenizer(reference: Manifest, reference_dir: str | os.PathLike, found: str, what: str, fix: str) -> None:
    """The one tokenizer check: DstrainError unless tokenizer hash ``found`` (of ``what``: another prepared folder,
    a tokenizer folder, a run's tokenizer) is the one ``reference_dir``'s data was prepared with. Equal vocabulary
    sizes are no proof; hashes are."""
    expected = reference.tokenizer.hash
    if found != expected:
        raise DstrainError(
            f"{what} has another tokenizer than the one {reference_dir} was prepared with "
            f"(tokenizer hash {found}, not manifest.json tokenizer.hash {expected}); {fix}"
        )


# --- the shards as prepared: their sizes and sampled content hashes ------------------------------------------------
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


def check_shards(folder: str | os.PathLike, manifest: Manifest) -> None:
    """Every shard the manifest lists is there, of its recorded size and sampled content hash: else one line naming
    the file. Reads at most 2 MiB per shard."""
    fix = "the data changed since it was prepared; restore it, or run `dstrain prepare` again into a new --out"
    for shard in manifest.shards:
        for ext, path in _shard_file_kinds(Path(folder) / shard.prefix, manifest.masked):
            if not path.is_file():
                raise DstrainError(f"{path}: missing, though {Path(folder) / MANIFEST_NAME} lists it; {fix}")
            size, expected = path.stat().st_size, getattr(shard, f"{ext}_bytes")
            if size != expected:
                raise DstrainError(f"{path}: {size} bytes, its manifest says {expected}; {fix}")
            if sampled_hash(path) != getattr(shard, f"{ext}_sampled_xxh3"):
                raise DstrainError(f"{path}: its content differs from what its manifest recorded (same size); {fix}")
