"""Where ``dstrain prepare`` reads text from: anything ``datasets`` can load, checked up front.

``--dataset`` may be a Hub id, a ``save_to_disk`` folder, a folder of data files, or
files/globs (json, jsonl, csv, txt, parquet, arrow; optionally .gz/.bz2/.xz/.zst).
Every bad input becomes a one-line DstrainError before anything is written.
"""

from __future__ import annotations

import bz2
import codecs
import difflib
import glob
import gzip
import hashlib
import lzma
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain.errors import DstrainError

# File extension -> the datasets builder that reads it.
BUILDER_OF_EXTENSION = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
TEXT_BUILDERS = {"json", "csv", "text"}
OPENER_OF_COMPRESSION = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}
_CHUNK = 1 << 20


@dataclass
class SourceSpec:
    """What the user asked to read (the --dataset family of flags)."""

    dataset: str  # Hub id, save_to_disk folder, data folder, file or glob
    config: str | None = None  # dataset configuration name (Hub datasets with several)
    split: str = "train"  # split to read
    text_field: str = "text"  # column holding each document's text
    streaming: bool = False  # iterate without downloading/converting the whole dataset first


@dataclass
class Source:
    """An opened, validated source: ``rows`` has only the text column."""

    spec: SourceSpec
    rows: Any  # datasets.Dataset or datasets.IterableDataset
    num_docs: int | None  # None when streaming (unknown until read)
    fingerprint: str  # identifies the content; equal fingerprints mean the same documents
    announced_docs: int | None = None  # when streaming: the row count the dataset's info gives, if any
    chat_format: str | None = None  # --chat: "messages" or "prompt-completion" (dstrain.data.chat), else None


def _builder_of(path: str) -> str | None:
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in OPENER_OF_COMPRESSION:
        suffixes = suffixes[:-1]
    return BUILDER_OF_EXTENSION.get(suffixes[-1]) if suffixes else None


def _hash_file(name: str, check_utf8: bool) -> str:
    """Content hash of one file (decompressed), checking UTF-8 on the way: one read."""
    digest = hashlib.blake2b(digest_size=16)
    compression = Path(name).suffix.lower()
    # No zstd module in the stdlib: hash the compressed bytes, leave UTF-8 to datasets.
    opener = OPENER_OF_COMPRESSION.get(compression, open) or open
    check = check_utf8 and compression != ".zst"
    decoder = codecs.getincrementaldecoder("utf-8")() if check else None
    offset = lines = 0
    with opener(name, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if decoder is not None:
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    line = lines + chunk.count(b"\n", 0, e.start) + 1
                    raise DstrainError(
                        f"{name}: byte {offset + e.start} (line {line}) is not valid UTF-8 ({e.reason}); "
                        f"re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                    ) from None
                lines += chunk.count(b"\n")
            offset += len(chunk)
    if decoder is not None:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise DstrainError(
                f"{name}: ends inside a UTF-8 sequence ({e.reason}); re-encode the file as UTF-8"
            ) from None
    return digest.hexdigest()


def combine_digests(digests: list[str]) -> str:
    """The fingerprint of files from their own hashes, in order: tasks that each hash some of the
    files give, together, the fingerprint of one process hashing them all."""
    digest = hashlib.blake2b(digest_size=16)
    for file_digest in digests:
        digest.update(bytes.fromhex(file_digest))
    return digest.hexdigest()


def _hash_files(files: list[str], check_utf8: bool) -> str:
    """The fingerprint of ``files``, in order."""
    return combine_digests([_hash_file(name, check_utf8) for name in files])


def _data_files(spec: str) -> list[str]:
    if any(c in spec for c in "*?["):
        files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
        if not files:
            raise DstrainError(f"--dataset {spec!r}: no file matches this pattern; check the path")
        return files
    return [spec]


def _unreadable(spec: SourceSpec, error: BaseException, where: str = "") -> DstrainError:
    while error.__cause__ is not None:  # datasets wraps the parser's error, which says what is wrong
        error = error.__cause__
    message = " ".join(str(error).split())[:300] or type(error).__name__
    return DstrainError(f"--dataset {spec.dataset!r} (split {spec.split!r}) could not be read{where}: {message}")


def _empty(spec: SourceSpec) -> DstrainError:
    return DstrainError(f"--dataset {spec.dataset!r} (split {spec.split!r}) has no rows; check --dataset and --split")


def _load(path: str, spec: SourceSpec, **kwargs):
    import datasets
    from datasets.exceptions import DatasetNotFoundError, DatasetsError
    from pyarrow import ArrowException

    try:
        return datasets.load_dataset(path, spec.config, split=spec.split, streaming=spec.streaming, **kwargs)
    except (DatasetNotFoundError, ConnectionError):
        from huggingface_hub import constants

        offline = constants.HF_HUB_OFFLINE
        where = "found locally (offline: HF_HUB_OFFLINE=1)" if offline else "a local path or a Hub dataset"
        raise DstrainError(
            f"--dataset {spec.dataset!r} is not {where}; pass an existing folder or file, or a Hub id you can reach"
        ) from None
    except StopIteration:  # what the json builder raises on an empty file
        raise _empty(spec) from None
    except (DatasetsError, ValueError, OSError, ArrowException) as e:
        raise _unreadable(spec, e) from None


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _folder_files(path: Path, spec: SourceSpec) -> list[str]:
    """The files of ``spec.split`` that ``load_dataset(folder)`` reads, in its order (its own split inference)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except (FileNotFoundError, ValueError):
        return []
    return [str(f) for f in files.get(spec.split, []) if _builder_of(str(f))]


def local_files(spec: SourceSpec) -> list[str] | None:
    """The data files a local folder, file or glob is read from, in reading order; None for a Hub id
    or a ``save_to_disk`` folder (read by rows)."""
    path = Path(spec.dataset)
    if _is_saved_dataset(path):
        return None
    if path.is_dir():
        return _folder_files(path, spec)
    if path.is_file() or any(c in spec.dataset for c in "*?["):
        return _data_files(spec.dataset)
    return None


def _files_builder(spec: SourceSpec, files: list[str]) -> str:
    builders = {_builder_of(f) for f in files}
    if None in builders or len(builders) > 1:
        raise DstrainError(
            f"--dataset {spec.dataset!r}: files must share one known format "
            f"({', '.join(BUILDER_OF_EXTENSION)}, optionally compressed); got {sorted(map(str, builders))}"
        )
    builder = builders.pop()
    assert builder is not None  # None was refused above
    return builder


def _open_rows(spec: SourceSpec):
    """(rows, fingerprint) for any supported --dataset."""
    import datasets

    path = Path(spec.dataset)
    if _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise DstrainError(f"{path}: no split {spec.split!r} (--split); available: {', '.join(loaded)}")
            loaded = loaded[spec.split]
        rows = loaded.to_iterable_dataset() if spec.streaming else loaded
        return rows, f"disk:{loaded._fingerprint}"
    if path.is_dir():
        if not any(p.is_file() and _builder_of(str(p)) for p in path.rglob("*")):
            raise DstrainError(f"--dataset {path}: folder holds no data files ({', '.join(BUILDER_OF_EXTENSION)})")
        rows = _load(str(path), spec)
        split_files = _folder_files(path, spec)
        return rows, _hash_files(split_files, check_utf8=any(_builder_of(f) in TEXT_BUILDERS for f in split_files))
    files = local_files(spec)
    if files is not None:
        builder = _files_builder(spec, files)
        rows = _load(builder, spec, data_files={spec.split: files})
        return rows, _hash_files(files, check_utf8=builder in TEXT_BUILDERS)
    rows = _load(spec.dataset, spec)
    hub_fingerprint = getattr(rows, "_fingerprint", None)
    fingerprint = f"hub:{hub_fingerprint}" if hub_fingerprint else f"hub:{spec.dataset}:{spec.config}:{spec.split}"
    return rows, fingerprint


def _check_text_field(spec: SourceSpec, columns: list[str]) -> None:
    if spec.text_field in columns:
        return
    close = difflib.get_close_matches(spec.text_field, columns, n=1)
    hint = f"did you mean --text-field {close[0]}? " if close else ""
    raise DstrainError(
        f"--dataset {spec.dataset!r} has no column {spec.text_field!r} (--text-field); {hint}"
        f"available columns: {', '.join(columns) or '(none)'}"
    )


def open_source(spec: SourceSpec) -> Source:
    """Load and validate the source: text column present and textual, at least one row."""
    return _validated(spec, *_open_rows(spec))


def open_files(spec: SourceSpec, files: list[str]) -> tuple[Source, list[str]]:
    """Only ``files`` of ``spec`` (a task's part), validated; and each file's content hash."""
    builder = _files_builder(spec, files)
    digests = [_hash_file(name, builder in TEXT_BUILDERS) for name in files]
    rows = _load(builder, spec, data_files={spec.split: files})
    return _validated(spec, rows, combine_digests(digests)), digests


def _validated(spec: SourceSpec, rows, fingerprint: str) -> Source:
    import datasets

    if isinstance(rows, datasets.Dataset):
        _check_text_field(spec, rows.column_names)
        feature = rows.features[spec.text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DstrainError(
                f"--dataset {spec.dataset!r}: column {spec.text_field!r} (--text-field) holds {feature}, not text; "
                f"pick the column with the documents' text"
            )
        if len(rows) == 0:
            raise _empty(spec)
        return Source(spec, rows.select_columns([spec.text_field]), len(rows), fingerprint)
    first = next(_guarded(spec, iter(rows.take(1)), 0), None)
    if first is None:
        raise _empty(spec)
    _check_text_field(spec, list(first))
    splits = getattr(rows.info, "splits", None) or {}
    announced = splits[spec.split].num_examples if spec.split in splits else None
    return Source(spec, rows.select_columns([spec.text_field]), None, fingerprint, announced or None)


def open_chat_source(spec: SourceSpec, files: list[str] | None = None) -> tuple[Source, list[str] | None]:
    """``--chat``: the source with only its conversation columns, its ``chat_format`` set; ``files``: a task's part
    only, then also each file's content hash (as ``open_files``)."""
    import datasets

    from dstrain.data.chat import example_format
    from dstrain.data.pairs import PAIR_FORMAT, pair_columns

    digests = None
    if files is not None:
        builder = _files_builder(spec, files)
        digests = [_hash_file(name, builder in TEXT_BUILDERS) for name in files]
        rows, fingerprint = _load(builder, spec, data_files={spec.split: files}), combine_digests(digests)
    else:
        rows, fingerprint = _open_rows(spec)
    if isinstance(rows, datasets.Dataset):
        if len(rows) == 0:
            raise _empty(spec)
        columns, num_docs = rows.column_names, len(rows)
    else:
        first = next(_guarded(spec, iter(rows.take(1)), 0), None)
        if first is None:
            raise _empty(spec)
        columns, num_docs = list(first), None
    kept = pair_columns(columns)  # TRL's preference format: chosen/rejected (data/pairs.py)
    fmt = PAIR_FORMAT if kept is not None else example_format(columns)
    if kept is None:
        kept = ["messages"] if fmt == "messages" else ["prompt", "completion"]
    return Source(spec, rows.select_columns(kept), num_docs, fingerprint, None, fmt), digests


def example_batches(source: Source, start: int, batch_docs: int) -> Iterator[list[dict]]:
    """Rows ``start, start+1, ...`` as lists of ``batch_docs`` dicts of the source's columns."""
    if source.num_docs is not None:
        batches = (source.rows[a : a + batch_docs] for a in range(start, source.num_docs, batch_docs))
    else:
        batches = source.rows.skip(start).iter(batch_size=batch_docs)
    for columns in _guarded(source.spec, batches, start):
        names = list(columns)
        yield [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


def _guarded(spec: SourceSpec, items: Iterator, start: int) -> Iterator:
    """``items``, with read errors met while streaming turned into one-line DstrainErrors."""
    from datasets.exceptions import DatasetsError
    from pyarrow import ArrowException

    try:
        yield from items
    except (DatasetsError, ArrowException) as e:
        raise _unreadable(spec, e, f" after document {start}") from None


def text_batches(source: Source, start: int, batch_docs: int) -> Iterator[list[str]]:
    """Documents ``start, start+1, ...`` as lists of ``batch_docs`` texts (None becomes "")."""
    field = source.spec.text_field
    if source.num_docs is not None:
        batches = (source.rows[a : a + batch_docs][field] for a in range(start, source.num_docs, batch_docs))
    else:
        batches = (batch[field] for batch in source.rows.skip(start).iter(batch_size=batch_docs))
    doc = start
    for texts in _guarded(source.spec, batches, start):
        if not all(type(t) is str for t in texts):
            for i, text in enumerate(texts):
                if text is None:
                    texts[i] = ""
                elif not isinstance(text, str):
                    raise DstrainError(
                        f"--dataset {source.spec.dataset!r}: row {doc + i} column {source.spec.text_field!r} "
                        f"holds {type(text).__name__}, not text; pick the column with the documents' text"
                    )
        yield texts
        doc += len(texts)


def describe(spec: SourceSpec) -> dict:
    """The manifest's record of a source (paths made absolute so they stay meaningful)."""
    local = Path(spec.dataset).exists() or any(c in spec.dataset for c in "*?[")
    dataset = os.path.abspath(spec.dataset) if local else spec.dataset
    return {"dataset": dataset, "config": spec.config, "split": spec.split, "text_field": spec.text_field}
