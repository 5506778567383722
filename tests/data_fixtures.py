"""Reusable prepared data for tests: real text (the stdlib's docs), tokenized by `dstrain prepare`.

    from data_fixtures import prepared_corpus, tiny_corpus   # tiny_corpus: session fixture
    folder = prepared_corpus(tmp_path)                        # -> Path with manifest.json

The same arguments in the same folder return the already-prepared folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from the Hub in tests
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from dstrain.data.corpus import write_stdlib_corpus  # noqa: E402
from dstrain.data.prepare import prepare  # noqa: E402

TINY_DOCS = 300
TINY_VOCAB = 512
TINY_SHARD_TOKENS = 25_000  # small enough that the tiny corpus spans several shards


def corpus_file(tmp_dir: str | os.PathLike, n_docs: int = TINY_DOCS, skip_docs: int = 0) -> Path:
    """A jsonl of stdlib documentation documents ``skip_docs .. skip_docs + n_docs`` (written once)."""
    path = Path(tmp_dir) / f"stdlib_{skip_docs}_{n_docs}.jsonl"
    if not path.exists():
        full = Path(tmp_dir) / f".stdlib_{n_docs + skip_docs}.jsonl"
        write_stdlib_corpus(full, max_docs=n_docs + skip_docs)
        lines = full.read_text(encoding="utf-8").splitlines(keepends=True)[skip_docs:]
        path.write_text("".join(lines), encoding="utf-8")
        full.unlink()
    return path


def read_texts(path: str | os.PathLike) -> list[str]:
    return [json.loads(line)["text"] for line in Path(path).read_text(encoding="utf-8").splitlines()]


def prepared_corpus(
    tmp_dir: str | os.PathLike,
    n_docs: int = TINY_DOCS,
    vocab_size: int = TINY_VOCAB,
    shard_tokens: int = TINY_SHARD_TOKENS,
    skip_docs: int = 0,
    name: str | None = None,
) -> Path:
    """Prepare ``n_docs`` stdlib documents with a trained BPE into ``tmp_dir/name``; returns the folder."""
    tmp_dir = Path(tmp_dir)
    out = tmp_dir / (name or f"prepared_{skip_docs}_{n_docs}_{vocab_size}_{shard_tokens}")
    if not (out / "manifest.json").is_file():
        source = corpus_file(tmp_dir, n_docs, skip_docs)
        prepare(
            str(source), str(out), train_tokenizer=vocab_size, shard_tokens=shard_tokens, num_proc=1, progress=False
        )
    return out


def copy_prepared(folder: Path, dest: Path) -> Path:
    """A private copy (without its index cache) that a test may damage."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("index_cache"))
    return dest


@pytest.fixture(scope="session")
def tiny_corpus() -> Path:
    """300 stdlib documents, BPE vocab 512, several shards. Read-only: copy it before damaging it. Prepared once
    per test session, in the session folder that its xdist workers share: the first worker prepares it while the
    others wait on the lock."""
    from filelock import FileLock

    from workers import session_folder

    folder = session_folder() / "tiny_corpus"
    with FileLock(f"{folder}.lock"):
        folder.mkdir(exist_ok=True)
        return prepared_corpus(folder)
