"""`dstrain prepare`: manifest, shard bounds, resume, equivalent inputs, and the bad-input catalogue."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import dstrain.data.shard_writing as prepare_module  # where shards are written
from dstrain.data.manifest import read_manifest
from dstrain.data.prepare import prepare, verify_tokenizer
from dstrain.data.shards import ShardReader
from dstrain.data.tokenizer import save_tokenizer, tokenizer_hash, train_bpe_tokenizer
from dstrain.errors import DstrainError

from data_fixtures import TINY_SHARD_TOKENS, TINY_VOCAB, copy_prepared, corpus_file, read_texts

REPO = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: content hash and modification time."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard_*"))}


def source_of(folder: Path) -> str:
    return read_manifest(folder).source.dataset


def test_manifest_describes_the_shards(tiny_corpus):
    manifest = read_manifest(tiny_corpus)
    tokenizer = AutoTokenizer.from_pretrained(tiny_corpus / "tokenizer")
    assert manifest.vocab_size == len(tokenizer) == TINY_VOCAB
    assert manifest.eos_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert manifest.dtype == "uint16"
    assert manifest.tokenizer.hash == tokenizer_hash(tokenizer)
    assert manifest.source.text_field == "text" and manifest.source.fingerprint
    assert manifest.command.startswith("dstrain prepare --dataset ")
    readers = [ShardReader.open(tiny_corpus / s.prefix) for s in manifest.shards]
    assert [len(r) for r in readers] == [s.documents for s in manifest.shards]
    assert [int(r.sizes.sum()) for r in readers] == [s.tokens for s in manifest.shards]
    assert manifest.documents == sum(len(r) for r in readers) == len(read_texts(manifest.source.dataset))
    assert manifest.tokens == sum(s.tokens for s in manifest.shards)
    assert len(readers) >= 3
    # Each shard is cut before the first document that would overflow --shard-tokens.
    for shard, following in zip(readers, readers[1:]):
        assert int(shard.sizes.sum()) <= TINY_SHARD_TOKENS or len(shard) == 1
        assert int(shard.sizes.sum()) + int(following.sizes[0]) > TINY_SHARD_TOKENS
    verify_tokenizer(manifest, tiny_corpus, tiny_corpus / "tokenizer")  # the saved tokenizer is the manifest's


def test_interrupted_prepare_rewrites_only_the_missing_shard(tmp_path, tiny_corpus, monkeypatch):
    out = copy_prepared(tiny_corpus, tmp_path / "out")
    original_bytes = shard_bytes(out)
    original_manifest = read_manifest(out)
    (out / "manifest.json").unlink()
    (out / "shard_00001.bin").unlink()
    (out / "shard_00001.idx").unlink()
    (out / "shard_00002.bin.tmp").write_bytes(b"half-written by a killed run")
    before = snapshot(out)
    written = []

    class CountingWriter(prepare_module.ShardWriter):
        def __init__(self, prefix, dtype, *masked):
            written.append(Path(prefix).name)
            super().__init__(prefix, dtype, *masked)

    monkeypatch.setattr(prepare_module, "ShardWriter", CountingWriter)
    manifest = prepare(
        source_of(tiny_corpus),
        out,
        train_tokenizer=TINY_VOCAB,
        shard_tokens=TINY_SHARD_TOKENS,
        num_proc=1,
        progress=False,
    )
    assert written == ["shard_00001"]
    after = snapshot(out)
    untouched = [name for name in before if name not in ("prepare_inputs.json", "shard_00002.bin.tmp")]
    assert all(after[name] == before[name] for name in untouched)  # tokenizer and other shards kept
    assert shard_bytes(out) == original_bytes  # the rewritten shard is identical, the .tmp is gone
    drop = lambda m: dataclasses.replace(m, command="")  # noqa: E731
    assert drop(manifest) == drop(original_manifest)
    assert drop(read_manifest(out)) == drop(original_manifest)


def test_a_prepare_hashes_its_tokenizer_once(tmp_path, tiny_corpus, monkeypatch):
    """A resumed --train-tokenizer prepare hashes the tokenizer it saved once and reuses it; a fresh --tokenizer one
    hashes the given tokenizer once (dstrain.data.prepare.HashedTokenizer)."""
    import dstrain.data.prepare as prepare_code

    hashed: list[str] = []
    monkeypatch.setattr(prepare_code, "tokenizer_hash", lambda t: hashed.append(tokenizer_hash(t)) or hashed[-1])
    out = copy_prepared(tiny_corpus, tmp_path / "out")
    (out / "manifest.json").unlink()
    (out / "shard_00001.bin").unlink()
    options = dict(shard_tokens=TINY_SHARD_TOKENS, num_proc=1, progress=False)
    prepare(source_of(tiny_corpus), out, train_tokenizer=TINY_VOCAB, **options)
    assert hashed == [read_manifest(tiny_corpus).tokenizer.hash]
    hashed.clear()
    prepare(source_of(tiny_corpus), tmp_path / "given", tokenizer=str(tiny_corpus / "tokenizer"), **options)
    assert hashed == [read_manifest(tmp_path / "given").tokenizer.hash]


def test_rerun_of_a_complete_folder_changes_nothing(tmp_path, tiny_corpus):
    out = copy_prepared(tiny_corpus, tmp_path / "out")
    before = snapshot(out)
    prepare(
        source_of(tiny_corpus),
        out,
        train_tokenizer=TINY_VOCAB,
        shard_tokens=TINY_SHARD_TOKENS,
        num_proc=1,
        progress=False,
    )
    assert snapshot(out) == before


def _as_parquet(src: Path, dest: Path) -> str:
    import datasets

    rows = [{"id": i, "text": t} for i, t in enumerate(read_texts(src))]
    datasets.Dataset.from_list(rows).to_parquet(dest / "c.parquet")
    return str(dest / "c.parquet")


def _as_saved_dataset(src: Path, dest: Path) -> str:
    import datasets

    datasets.Dataset.from_list([{"text": t} for t in read_texts(src)]).save_to_disk(dest / "saved")
    return str(dest / "saved")


def _as_gzip_parts(src: Path, dest: Path) -> str:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    for part, start in enumerate(range(0, len(lines), 128)):  # part_0 < part_1 < part_2 in glob order
        with gzip.open(dest / f"part_{part}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines[start : start + 128])
    return str(dest / "part_*.jsonl.gz")


@pytest.mark.parametrize(
    "make_source, streaming",
    [
        (lambda src, dest: str(src), True),
        (_as_parquet, False),
        (_as_saved_dataset, False),
        (_as_saved_dataset, True),
        (_as_gzip_parts, False),
    ],
)
def test_every_source_kind_gives_the_same_shards(tmp_path, tiny_corpus, make_source, streaming):
    dataset = make_source(Path(source_of(tiny_corpus)), tmp_path)
    out = tmp_path / "out"
    prepare(
        dataset,
        out,
        tokenizer=str(tiny_corpus / "tokenizer"),
        shard_tokens=TINY_SHARD_TOKENS,
        streaming=streaming,
        num_proc=1,
        progress=False,
    )
    assert shard_bytes(out) == shard_bytes(tiny_corpus)
    verify_tokenizer(read_manifest(out), out, tiny_corpus / "tokenizer")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dstrain", "prepare", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.launcher
def test_cli_with_two_processes_matches_in_process_prepare(tmp_path, tiny_corpus):
    out = tmp_path / "out"
    result = run_cli(
        "--dataset",
        source_of(tiny_corpus),
        "--train-tokenizer",
        str(TINY_VOCAB),
        "--out",
        str(out),
        "--shard-tokens",
        str(TINY_SHARD_TOKENS),
        "--num-proc",
        "2",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    assert f"{out}: 300 documents" in result.stdout
    assert shard_bytes(out) == shard_bytes(tiny_corpus)
    verify_tokenizer(read_manifest(out), out, tiny_corpus / "tokenizer")


@pytest.mark.launcher
def test_cli_unknown_tokenizer_exits_2_with_one_line(tmp_path, tiny_corpus):
    out = tmp_path / "out"
    result = run_cli(
        "--dataset",
        source_of(tiny_corpus),
        "--tokenizer",
        "no-such-org/no-such-tokenizer",
        "--out",
        str(out),
        "--no-progress",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "dstrain: error: tokenizer 'no-such-org/no-such-tokenizer' (--tokenizer) is no folder under "
    )  # a Hub id in form, and a path too: both said
    assert "and could not be found locally" in lines[0]
    assert not out.exists()


# ---- the bad-input catalogue: each a one-line DstrainError, and nothing written or changed ----


def _bad_source(tmp_path: Path, tiny_corpus: Path, case: str) -> tuple[str, dict, str]:
    """(dataset, prepare options, expected message fragment) for one bad input."""
    good = source_of(tiny_corpus)
    tokenizer = {"tokenizer": str(tiny_corpus / "tokenizer")}
    if case == "misspelled text field":
        expected = "no column 'txt' (--text-field); did you mean --text-field text?"
        return good, {**tokenizer, "text_field": "txt"}, expected
    if case == "missing text field":
        return good, {**tokenizer, "text_field": "body"}, "no column 'body' (--text-field); available columns: text"
    if case == "empty dataset":
        (tmp_path / "empty.jsonl").write_text("")
        return str(tmp_path / "empty.jsonl"), tokenizer, "has no rows"
    if case == "non-UTF-8 bytes":
        path = tmp_path / "latin1.jsonl"
        path.write_bytes(b'{"text": "plain"}\n{"text": "caf\xe9 cr\xe8me"}\n')
        return str(path), tokenizer, f"{path}: byte 31 (line 2) is not valid UTF-8"
    if case == "unknown tokenizer":
        return good, {"tokenizer": str(tmp_path / "no_such_tokenizer_dir")}, "no such folder"
    if case == "no tokenizer":
        return good, {}, "pass exactly one of --tokenizer"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "misspelled text field",
        "missing text field",
        "empty dataset",
        "non-UTF-8 bytes",
        "unknown tokenizer",
        "no tokenizer",
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tiny_corpus, case):
    dataset, options, expected = _bad_source(tmp_path, tiny_corpus, case)
    inputs_before = snapshot(tmp_path)
    with pytest.raises(DstrainError) as error:
        prepare(dataset, tmp_path / "out", num_proc=1, progress=False, **options)
    assert "\n" not in str(error.value)
    assert expected in str(error.value)
    assert not (tmp_path / "out").exists()
    assert snapshot(tmp_path) == inputs_before


@pytest.mark.parametrize("change", ["other documents", "other tokenizer", "other text field", "other shard size"])
def test_output_folder_of_other_inputs_is_refused_untouched(tmp_path, tiny_corpus, change):
    out = copy_prepared(tiny_corpus, tmp_path / "out")
    options = {"train_tokenizer": TINY_VOCAB, "shard_tokens": TINY_SHARD_TOKENS}
    dataset = source_of(tiny_corpus)
    if change == "other documents":
        dataset, expected = str(corpus_file(tmp_path, n_docs=50, skip_docs=300)), "a different dataset"
    elif change == "other tokenizer":
        options["train_tokenizer"], expected = TINY_VOCAB * 2, f"--train-tokenizer {TINY_VOCAB}"
    elif change == "other text field":  # same file, another column
        titled = tmp_path / "titled.jsonl"
        titled.write_text("".join(json.dumps({"title": t[:40], "text": t}) + "\n" for t in read_texts(dataset)))
        out = tmp_path / "titled"
        prepare(titled, out, tokenizer=str(tiny_corpus / "tokenizer"), num_proc=1, progress=False)
        dataset, options = str(titled), {"tokenizer": str(tiny_corpus / "tokenizer"), "text_field": "title"}
        expected = "--text-field 'text'"
    else:
        options["shard_tokens"], expected = TINY_SHARD_TOKENS * 2, f"--shard-tokens {TINY_SHARD_TOKENS}"
    before = snapshot(out)
    with pytest.raises(DstrainError) as error:
        prepare(dataset, out, num_proc=1, progress=False, **options)
    message = str(error.value)
    assert "\n" not in message and expected in message and "choose another --out" in message
    assert snapshot(out) == before


def test_folder_holding_something_else_is_refused_untouched(tmp_path, tiny_corpus):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("my own file")
    before = snapshot(out)
    with pytest.raises(DstrainError, match="not empty and holds no `dstrain prepare` output"):
        prepare(source_of(tiny_corpus), out, tokenizer=str(tiny_corpus / "tokenizer"), num_proc=1, progress=False)
    assert snapshot(out) == before


def test_verify_tokenizer_rejects_another_tokenizer(tmp_path, tiny_corpus):
    texts = read_texts(source_of(tiny_corpus))
    other = train_bpe_tokenizer(iter([texts[:100]]), TINY_VOCAB, 100)
    save_tokenizer(other, tmp_path / "other")
    with pytest.raises(DstrainError) as error:
        verify_tokenizer(read_manifest(tiny_corpus), tiny_corpus, tmp_path / "other")
    message = str(error.value)
    assert "\n" not in message and "manifest.json tokenizer.hash" in message and str(tmp_path / "other") in message


def test_training_a_tokenizer_into_a_log_leaves_no_empty_lines(capfd):
    """tokenizers' progress bars draw on a terminal only; into a file or a pipe (pytest's capture here, a Slurm log,
    the demo piped) each of its three stages used to leave an empty line."""
    assert not sys.stderr.isatty()
    train_bpe_tokenizer(iter([["hello world, hello tokens"] * 50]), 300, 50, show_progress=True)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
