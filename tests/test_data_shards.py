"""MMIDIDX shards: round trip of real documents, Megatron compatibility, damaged files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from dstrain.data.dataset import build_dataset
from dstrain.data.manifest import read_manifest
from dstrain.data.shards import ShardReader, ShardWriter, token_dtype
from dstrain.errors import DstrainError

from data_fixtures import copy_prepared, read_texts

# Megatron-LM indexed_dataset.py DType codes, written out independently of our module.
MEGATRON_DTYPES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}


def megatron_read(prefix: Path) -> tuple[int, list[list[int]], list[int]]:
    """Read a shard with nothing but ``struct``, from the published MMIDIDX v1 layout.

    Returns (dtype code, token ids of every sequence, doc_idx)."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, count, doc_count = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    offset = 9 + 8 + 1 + 8 + 8
    sizes = struct.unpack_from(f"<{count}i", idx, offset)
    pointers = struct.unpack_from(f"<{count}q", idx, offset + 4 * count)
    doc_idx = list(struct.unpack_from(f"<{doc_count}q", idx, offset + 12 * count))
    assert len(idx) == offset + 12 * count + 8 * doc_count  # nothing after doc_idx
    data = Path(f"{prefix}.bin").read_bytes()
    fmt = MEGATRON_DTYPES[code]
    sequences = [list(struct.unpack_from(f"<{n}{fmt}", data, p)) for n, p in zip(sizes, pointers)]
    assert sum(sizes) * struct.calcsize(fmt) == len(data)
    return code, sequences, doc_idx


def test_megatron_reader_sees_every_document_tokenized_in_order(tiny_corpus):
    manifest = read_manifest(tiny_corpus)
    tokenizer = AutoTokenizer.from_pretrained(tiny_corpus / "tokenizer")
    texts = read_texts(manifest.source.dataset)
    sequences = []
    for shard in manifest.shards:
        code, shard_sequences, doc_idx = megatron_read(tiny_corpus / shard.prefix)
        assert code == 8  # uint16: vocabulary 512 < 65,500
        assert doc_idx == list(range(len(shard_sequences) + 1))
        assert len(shard_sequences) == shard.documents
        assert sum(map(len, shard_sequences)) == shard.tokens
        sequences += shard_sequences
    assert len(sequences) == len(texts) == manifest.documents
    expected = [ids + [manifest.eos_id] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    assert sequences == expected


def test_round_trip_decodes_every_document_then_eos(tiny_corpus):
    manifest = read_manifest(tiny_corpus)
    tokenizer = AutoTokenizer.from_pretrained(tiny_corpus / "tokenizer")
    eos = tokenizer.eos_token_id
    decoded = []
    for shard in manifest.shards:
        reader = ShardReader.open(tiny_corpus / shard.prefix)
        for i in range(len(reader)):
            ids = reader[i].tolist()
            assert ids[-1] == eos and eos not in ids[:-1]
            decoded.append(tokenizer.decode(ids[:-1]))
    assert decoded == read_texts(manifest.source.dataset)


def test_special_token_quoted_in_text_is_not_a_document_boundary(tmp_path, tiny_corpus):
    from dstrain.data.prepare import prepare

    text = "The GPT-2 separator is written <|endoftext|> in its vocabulary."
    source = tmp_path / "quote.jsonl"
    source.write_text(json.dumps({"text": text}) + "\n")
    manifest = prepare(source, tmp_path / "out", tokenizer=str(tiny_corpus / "tokenizer"), num_proc=1, progress=False)
    ids = ShardReader.open(tmp_path / "out" / "shard_00000")[0].tolist()
    assert manifest.documents == 1 and ids.count(manifest.eos_id) == 1 and ids[-1] == manifest.eos_id


@pytest.mark.parametrize("vocab_size, code, limit", [(65_499, 8, 65_498), (65_500, 4, 151_000)])
def test_dtype_follows_vocabulary_and_round_trips(tmp_path, vocab_size, code, limit):
    dtype = token_dtype(vocab_size)
    docs = [np.array([limit, 0, 7], dtype=np.int64), np.array([limit // 2], dtype=np.int64)]
    writer = ShardWriter(tmp_path / "s", dtype)
    writer.add(np.concatenate(docs), np.array([3, 1]))
    assert writer.finish() == (2, 4)
    read_code, sequences, _ = megatron_read(tmp_path / "s")
    assert read_code == code
    assert sequences == [d.tolist() for d in docs]
    reader = ShardReader.open(tmp_path / "s")
    assert [reader[i].tolist() for i in range(len(reader))] == sequences
    assert not list(tmp_path.glob("*.tmp"))


def _damage_and_check(folder: Path, damage, expected: str) -> None:
    damaged_files = {p: p.read_bytes() for p in folder.glob("shard_*")}
    damage()
    after_damage = {p: p.read_bytes() for p in folder.glob("shard_*")}
    with pytest.raises(DstrainError) as error:
        build_dataset([(str(folder), 1.0)], "train", 64, seed=0, num_samples=None, valid_fraction=0.1)
    message = str(error.value)
    assert "\n" not in message and expected in message and "dstrain prepare" in message
    assert {p: p.read_bytes() for p in folder.glob("shard_*")} == after_damage  # nothing rewritten
    assert after_damage != damaged_files


def test_truncated_bin_is_reported_with_its_file(tmp_path, tiny_corpus):
    folder = copy_prepared(tiny_corpus, tmp_path / "copy")
    bin_path = folder / "shard_00001.bin"

    def truncate():
        bin_path.write_bytes(bin_path.read_bytes()[:-10])

    _damage_and_check(folder, truncate, f"{bin_path}: holds")


def test_wrong_magic_is_reported_with_its_file(tmp_path, tiny_corpus):
    folder = copy_prepared(tiny_corpus, tmp_path / "copy")
    idx_path = folder / "shard_00000.idx"

    def corrupt():
        idx_path.write_bytes(b"NOTMMIDX\x00" + idx_path.read_bytes()[9:])

    _damage_and_check(folder, corrupt, f"{idx_path}: not a Megatron MMIDIDX index")
