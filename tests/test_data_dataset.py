"""The packed dataset: packing, position ids, splits, epochs, blending, the index cache."""

from __future__ import annotations

import multiprocessing
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain.data import index as index_lib
from dstrain.data.dataset import PreparedTokens, build_dataset, collate
from dstrain.data.manifest import read_manifest
from dstrain.data.prepare import prepare
from dstrain.errors import DstrainError

from data_fixtures import corpus_file

SEQ_LEN = 64
VALID_FRACTION = 0.1


@pytest.fixture(scope="module")
def blend_sources(tmp_path_factory, tiny_corpus) -> list[Path]:
    """The tiny corpus plus two disjoint slices of further stdlib docs, all with its tokenizer."""
    tmp = tmp_path_factory.mktemp("blend")
    folders = [tiny_corpus]
    for skip in (300, 450):
        out = tmp / f"docs_{skip}"
        prepare(
            corpus_file(tmp, n_docs=150, skip_docs=skip),
            out,
            tokenizer=str(tiny_corpus / "tokenizer"),
            num_proc=1,
            progress=False,
        )
        folders.append(out)
    return folders


def epoch_stream(ds, epoch: int) -> np.ndarray:
    """The epoch's documents concatenated in its shuffled order, rebuilt from the shards."""
    docs = ds.doc_order[epoch * ds.docs_per_epoch : (epoch + 1) * ds.docs_per_epoch]
    return np.concatenate([ds.tokens.document(int(d)) for d in docs]).astype(np.int64)


def test_samples_are_overlapping_windows_of_the_shuffled_document_stream(tiny_corpus, tmp_path):
    ds = build_dataset(
        [(str(tiny_corpus), 1.0)],
        "train",
        SEQ_LEN,
        seed=3,
        num_samples=None,
        valid_fraction=VALID_FRACTION,
        cache_dir=tmp_path,
    )
    stream = epoch_stream(ds, 0)
    assert len(ds) == ds.samples_per_epoch == (stream.size - 1) // SEQ_LEN
    assert sorted(ds.sample_order.tolist()) == list(range(len(ds)))
    assert ds.sample_order.tolist() != sorted(ds.sample_order.tolist())  # sample order is shuffled
    for i in range(len(ds)):
        window = int(ds.sample_order[i])
        sample = ds[i]
        assert sample["tokens"].dtype == np.int64 and sample["tokens"].shape == (SEQ_LEN + 1,)
        np.testing.assert_array_equal(sample["tokens"], stream[window * SEQ_LEN : window * SEQ_LEN + SEQ_LEN + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_position_ids_restart_at_every_document_start(tiny_corpus, tmp_path):
    eos = read_manifest(tiny_corpus).eos_id
    ds = build_dataset(
        [(str(tiny_corpus), 1.0)],
        "train",
        256,
        seed=0,
        num_samples=None,
        valid_fraction=VALID_FRACTION,
        cache_dir=tmp_path,
    )
    restarts = 0
    for i in range(len(ds)):
        sample = ds[i]
        tokens, positions = sample["tokens"], sample["position_ids"]
        assert positions.dtype == np.int64 and positions.shape == (256,)
        expected = np.zeros(256, dtype=np.int64)
        for t in range(1, 256):
            expected[t] = 0 if tokens[t - 1] == eos else expected[t - 1] + 1
        np.testing.assert_array_equal(positions, expected)
        restarts += int((tokens[:255] == eos).sum())
    # Each document boundary falls inside one window (bar those at a window's very end).
    assert restarts > 0.9 * ds.docs_per_epoch


def test_split_is_deterministic_disjoint_and_sized(tiny_corpus, tmp_path):
    def docs(split, seed, cache):
        ds = build_dataset([(str(tiny_corpus), 1.0)], split, SEQ_LEN, seed, None, VALID_FRACTION, cache_dir=cache)
        return set(ds.doc_order[: ds.docs_per_epoch].tolist())

    train, valid = docs("train", 5, tmp_path / "a"), docs("valid", 5, tmp_path / "a")
    num_docs = read_manifest(tiny_corpus).documents
    assert not train & valid and train | valid == set(range(num_docs))
    assert len(valid) == round(VALID_FRACTION * num_docs)
    assert docs("valid", 5, tmp_path / "b") == valid  # rebuilt from scratch: the same split
    assert docs("valid", 6, tmp_path / "b") != valid  # the split follows the seed


def test_epochs_reshuffle_and_longer_runs_keep_earlier_samples(tiny_corpus, tmp_path):
    def build(num_samples):
        return build_dataset(
            [(str(tiny_corpus), 1.0)],
            "train",
            SEQ_LEN,
            seed=11,
            num_samples=num_samples,
            valid_fraction=VALID_FRACTION,
            cache_dir=tmp_path,
        )

    one = build(None)
    per_epoch = one.samples_per_epoch
    short, long = build(2 * per_epoch + 7), build(3 * per_epoch + 1)
    assert len(short) == 2 * per_epoch + 7 and len(long) == 3 * per_epoch + 1
    for i in range(len(short)):
        np.testing.assert_array_equal(short[i]["tokens"], long[i]["tokens"])
    for i in range(per_epoch):
        np.testing.assert_array_equal(one[i]["tokens"], long[i]["tokens"])
    orders = [long.doc_order[e * long.docs_per_epoch : (e + 1) * long.docs_per_epoch].tolist() for e in range(3)]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(orders[2]) and orders[0] != orders[1] != orders[2]
    stream = epoch_stream(long, 1)  # a second-epoch sample is a window of the second epoch's stream
    window = int(long.sample_order[per_epoch + 4])
    np.testing.assert_array_equal(long[per_epoch + 4]["tokens"], stream[window * SEQ_LEN : (window + 1) * SEQ_LEN + 1])


def test_blend_follows_the_weights_in_every_prefix(blend_sources, tmp_path):
    weights = [0.2, 0.3, 0.5]
    sources = [(str(f), w) for f, w in zip(blend_sources, weights)]
    ds = build_dataset(
        sources, "train", SEQ_LEN, seed=1, num_samples=3000, valid_fraction=VALID_FRACTION, cache_dir=tmp_path
    )
    assert len(ds) == 3000
    counts = np.cumsum(np.eye(3, dtype=np.int64)[ds.source], axis=0)  # counts[n-1, s]: source s in the first n
    expected = np.arange(1, 3001)[:, None] * np.array(weights)[None, :]
    assert np.abs(counts - expected).max() <= 1.0  # every prefix within one sample of its weight
    for i in (0, 1, 2, 999, 2999):  # sample i is sample k of source s
        s, k = int(ds.source[i]), int(ds.sample[i])
        np.testing.assert_array_equal(ds[i]["tokens"], ds.datasets[s][k]["tokens"])
    shorter = build_dataset(
        sources, "train", SEQ_LEN, seed=1, num_samples=700, valid_fraction=VALID_FRACTION, cache_dir=tmp_path
    )
    assert shorter.source.tolist() == ds.source[:700].tolist()
    for i in range(0, 700, 37):
        np.testing.assert_array_equal(shorter[i]["tokens"], ds[i]["tokens"])


def test_valid_blend_holds_each_valid_sample_once(blend_sources, tmp_path):
    sources = [(str(f), 1.0) for f in blend_sources]
    ds = build_dataset(
        sources, "valid", SEQ_LEN, seed=1, num_samples=None, valid_fraction=VALID_FRACTION, cache_dir=tmp_path
    )
    for s, part in enumerate(ds.datasets):
        assert sorted(ds.sample[ds.source == s].tolist()) == list(range(len(part)))
    assert len(ds) == sum(len(part) for part in ds.datasets)


def test_sources_with_different_tokenizers_are_refused(tiny_corpus, tmp_path):
    """The one tokenizer check (the launch's check phase runs it over data.sources, eval over --data): by hash."""
    from dstrain.data.manifest import same_tokenizer

    other = tmp_path / "other"
    prepare(corpus_file(tmp_path, n_docs=100), other, train_tokenizer=300, num_proc=1, progress=False)
    reference = read_manifest(tiny_corpus)
    same_tokenizer(reference, tiny_corpus, reference.tokenizer.hash, "itself", "no fix")  # the same: accepted
    theirs = read_manifest(other).tokenizer.hash
    expected = rf"^data.sources {other} has another tokenizer than the one {tiny_corpus} was prepared with .*; fix it$"
    with pytest.raises(DstrainError, match=expected):
        same_tokenizer(reference, tiny_corpus, theirs, f"data.sources {other}", "fix it")


def test_index_cache_is_reused_and_keyed_by_every_input(blend_sources, tmp_path):
    cache = tmp_path / "cache"

    def build(folder=blend_sources[0], **changes):
        args = {"split": "train", "seq_len": SEQ_LEN, "seed": 0, "num_samples": 10, "valid_fraction": VALID_FRACTION}
        before = entries()
        ds = build_dataset([(str(folder), 1.0)], cache_dir=cache, **{**args, **changes})
        return ds, entries() - before

    def entries() -> int:  # each index the cache holds is one folder
        return sum(p.is_dir() for p in cache.iterdir()) if cache.exists() else 0

    ds, built = build()
    assert built == 2  # the split, then the epochs
    assert isinstance(ds.doc_order, np.memmap) and isinstance(ds.sample_order, np.memmap)
    files = {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")}
    again, built = build()
    assert built == 0 and {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")} == files
    np.testing.assert_array_equal(again[3]["tokens"], ds[3]["tokens"])
    assert build(seq_len=SEQ_LEN * 2)[1] == 1  # same split, new epochs
    assert build(seed=1)[1] == 2
    assert build(valid_fraction=0.2)[1] == 2
    assert build(num_samples=ds.samples_per_epoch + 1)[1] == 1  # a second epoch
    assert build(num_samples=5)[1] == 0  # still one epoch: reused
    assert build(folder=blend_sources[1])[1] == 2  # other data, same cache folder


def _build_slowly(cache: str, log: str, queue) -> None:
    def slow_build():
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        return {"values": np.arange(1000)}

    arrays = index_lib.cached_arrays(Path(cache), {"kind": "test"}, slow_build)
    queue.put(int(arrays["values"].sum()))


def test_concurrent_processes_build_an_index_once(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    log = tmp_path / "builds.log"
    workers = [context.Process(target=_build_slowly, args=(str(tmp_path / "cache"), str(log), queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0, 0, 0, 0]
    assert sorted(queue.get(timeout=5) for _ in workers) == [499500] * 4
    assert log.read_text() == "built\n"
    assert not list((tmp_path / "cache").glob(".*tmp*"))


def test_collate_shifts_tokens_into_inputs_and_labels(tiny_corpus, tmp_path):
    ds = build_dataset([(str(tiny_corpus), 1.0)], "train", SEQ_LEN, 0, 8, VALID_FRACTION, cache_dir=tmp_path)
    batch = collate([ds[i] for i in range(4)])
    tokens = np.stack([ds[i]["tokens"] for i in range(4)])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for name in batch:
        assert batch[name].dtype == torch.int64 and batch[name].shape == (4, SEQ_LEN)
    np.testing.assert_array_equal(batch["input_ids"].numpy(), tokens[:, :-1])
    np.testing.assert_array_equal(batch["labels"].numpy(), tokens[:, 1:])
    np.testing.assert_array_equal(batch["position_ids"][2].numpy(), ds[2]["position_ids"])


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"split": "valid", "valid_fraction": 0.0}, "split 'valid' with valid_fraction 0 is empty"),
        ({"split": "test"}, "split 'test': must be one of train, valid"),
        ({"weight": 0.0}, "every weight is 0; give at least one source a positive weight"),
        ({"weight": -1.0}, "weight -1.0 must be a number >= 0"),
        ({"seq_len": 10**9}, "not enough for one sample"),
    ],
)
def test_bad_dataset_arguments_are_one_line_errors(tiny_corpus, tmp_path, arguments, expected):
    args = {"split": "train", "seq_len": SEQ_LEN, "seed": 0, "num_samples": 10, "valid_fraction": VALID_FRACTION}
    weight = arguments.pop("weight", 1.0)
    with pytest.raises(DstrainError) as error:
        build_dataset([(str(tiny_corpus), weight)], cache_dir=tmp_path, **{**args, **arguments})
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_unprepared_folder_says_run_prepare_first(tmp_path):
    with pytest.raises(DstrainError) as error:
        read_manifest(tmp_path)
    assert "run `dstrain prepare" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DstrainError, match="run `dstrain prepare"):
        PreparedTokens(tmp_path)


def test_datasets_pickle_small_and_read_the_same_samples(blend_sources, tmp_path):
    single = build_dataset([(str(blend_sources[0]), 1.0)], "train", SEQ_LEN, 0, 500, VALID_FRACTION, cache_dir=tmp_path)
    blended = build_dataset(
        [(str(f), 1.0) for f in blend_sources], "train", SEQ_LEN, 0, 500, VALID_FRACTION, cache_dir=tmp_path
    )
    for ds in (single, blended):
        payload = pickle.dumps(ds)
        assert len(payload) < 4096  # paths and arguments, not the memory-mapped arrays
        copy = pickle.loads(payload)
        assert len(copy) == len(ds)
        for i in (0, 17, 499):
            np.testing.assert_array_equal(copy[i]["tokens"], ds[i]["tokens"])
