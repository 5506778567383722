"""A real-text corpus no one here wrote: the Python standard library's own documentation.

Every Python ships it, so the demo and the tests get natural English/code prose
without a download. Documents, in a fixed order:

1. the ``pydoc_data.topics.topics`` help entries (the language reference sections
   behind ``help("if")``), sorted by topic name;
2. the module, class and function docstrings of the standard library's ``.py``
   files (found with ``ast``, never imported), files in sorted path order,
   docstrings in ``ast.walk`` order, skipping those shorter than 200 characters.

Run ``python -m dstrain.data.corpus OUT.jsonl [--max-docs N]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

MIN_DOCSTRING_CHARS = 200
# Third-party packages and the interpreter's own regression-test data are not stdlib docs.
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _pydoc_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip()


def _stdlib_files(stdlib: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(root) / name


def _docstrings(path: Path) -> Iterator[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return  # a few files are deliberately broken (lib2to3 fixtures and the like)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                yield doc


def stdlib_documents(max_docs: int | None = None) -> Iterator[str]:
    """The corpus' documents, in their fixed order (first ``max_docs`` only if given)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    for doc in _pydoc_topics():
        if max_docs is not None and count >= max_docs:
            return
        yield doc
        count += 1
    for path in _stdlib_files(stdlib):
        for doc in _docstrings(path):
            if max_docs is not None and count >= max_docs:
                return
            yield doc
            count += 1


def write_stdlib_corpus(path: str | os.PathLike, max_docs: int | None = None) -> tuple[int, int]:
    """Write the corpus as jsonl of ``{"text": ...}``; returns (documents, characters)."""
    docs = chars = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in stdlib_documents(max_docs):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            docs += 1
            chars += len(text)
    return docs, chars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstrain.data.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output .jsonl file")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    args = parser.parse_args(argv)
    docs, chars = write_stdlib_corpus(args.out, args.max_docs)
    print(f"wrote {docs:,} documents, {chars:,} characters to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
