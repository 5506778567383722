"""The stdlib-documentation corpus: real text, fixed order, reproducible."""

from __future__ import annotations

import json
from pydoc_data.topics import topics

from dstrain.data.corpus import MIN_DOCSTRING_CHARS, main, write_stdlib_corpus


def test_corpus_is_pydoc_topics_then_long_docstrings_in_a_fixed_order(tmp_path):
    docs, chars = write_stdlib_corpus(tmp_path / "a.jsonl", max_docs=len(topics) + 60)
    texts = [json.loads(line)["text"] for line in (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    assert docs == len(texts) == len(topics) + 60 and chars == sum(map(len, texts))
    assert texts[: len(topics)] == [topics[name].strip() for name in sorted(topics)]
    assert all(len(text) >= MIN_DOCSTRING_CHARS for text in texts[len(topics) :])
    assert len(set(texts[len(topics) :])) > 50  # distinct docstrings, not one repeated
    write_stdlib_corpus(tmp_path / "b.jsonl", max_docs=len(topics) + 60)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_command_line_reports_documents_and_characters(tmp_path, capsys):
    assert main([str(tmp_path / "c.jsonl"), "--max-docs", "5"]) == 0
    expected_chars = sum(len(topics[name].strip()) for name in sorted(topics)[:5])
    expected = f"wrote 5 documents, {expected_chars:,} characters to {tmp_path / 'c.jsonl'}"
    assert capsys.readouterr().out.strip() == expected
