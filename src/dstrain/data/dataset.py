"""The training loader's dataset: fixed-length samples packed from prepared shards.

``build_dataset`` turns prepared folders (``dstrain prepare``) into a map-style dataset:
``ds[i]`` is ``seq_len + 1`` consecutive tokens of the shuffled document stream
(Megatron-style packing: documents are concatenated, EOS-separated, and consecutive
samples share one token), plus position ids that restart at every document start. Data prepared with
``--chat`` packs whole conversations instead and carries each token's loss mask (dstrain.data.chat_packing).
Everything is deterministic in the seed; sample ``i`` never depends on ``num_samples``.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from pathlib import Path

import numpy as np

from dstrain.data import index as index_lib
from dstrain.data.chat_packing import build_chat_epochs, chat_sample, pack_epoch
from dstrain.data.manifest import manifest_hash, read_manifest
from dstrain.data.pair_packing import pair_sample, pair_sizes
from dstrain.data.pairs import is_pair_folder
from dstrain.data.shards import ShardReader, mask_prefix
from dstrain.data.tokenizer import check_same_tokenizer
from dstrain.errors import DstrainError

SPLITS = ("train", "valid")
CACHE_DIR_NAME = "index_cache"

__all__ = [
    "read_manifest",
    "build_dataset",
    "build_valid_sets",
    "source_names",
    "collate",
    "PackedDataset",
    "BlendedDataset",
    "PreparedTokens",
]


class PreparedTokens:
    """Every document of one prepared folder, by global document id (shards in order)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.shards = [ShardReader.open(self.folder / shard["prefix"]) for shard in self.manifest["shards"]]
        for shard, record in zip(self.shards, self.manifest["shards"]):
            if len(shard) != record["documents"]:
                raise DstrainError(
                    f"{shard.prefix}.idx: {len(shard)} documents but manifest.json lists {record['documents']}; "
                    f"re-run `dstrain prepare` into a new --out"
                )
        counts = [len(shard) for shard in self.shards]
        self.first_doc = [0, *np.cumsum(counts).tolist()]  # python ints: bisect beats numpy here
        self.num_docs = self.first_doc[-1]
        self.hash = manifest_hash(self.manifest)
        self.chat = self.manifest.get("chat") is not None  # prepared with --chat: each shard has its loss mask
        self.masks = [ShardReader.open(mask_prefix(shard.prefix)) for shard in self.shards] if self.chat else []
        self.pairs = is_pair_folder(self.manifest)  # documents 2k, 2k + 1: pair k, packed whole (data/pair_packing.py)

    def sizes(self) -> np.ndarray:
        """Tokens (EOS included) of every document, in memory (4 bytes each)."""
        return np.concatenate([shard.sizes for shard in self.shards]) if self.shards else np.zeros(0, np.int32)

    def document(self, doc: int) -> np.ndarray:
        shard = bisect_right(self.first_doc, doc) - 1
        return self.shards[shard][doc - self.first_doc[shard]]

    def side(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss mask) of a document of a --chat folder."""
        return self.document(doc), self.document_mask(doc)

    def document_mask(self, doc: int) -> np.ndarray:
        """The loss mask of a --chat document: 1 where its token is learned."""
        shard = bisect_right(self.first_doc, doc) - 1
        return self.masks[shard][doc - self.first_doc[shard]]


class PackedDataset:
    """Samples of one prepared folder's split; see the module docstring."""

    def __init__(
        self,
        folder: str | os.PathLike,
        split: str,
        seq_len: int,
        seed: int,
        num_samples: int | None,
        valid_fraction: float,
        cache_dir: str | os.PathLike,
        overlong: str = "truncate",
    ):
        """``overlong``: what packing does with a --chat conversation longer than ``seq_len + 1`` tokens (see
        dstrain.data.chat_packing)."""
        self._arguments = (str(folder), split, seq_len, seed, num_samples, valid_fraction, str(cache_dir), overlong)
        self.tokens = tokens = PreparedTokens(folder)
        cache_dir = Path(cache_dir)
        self.seq_len = seq_len
        split_key = {
            "kind": "split",
            "data": tokens.hash,
            "split": split,
            "seed": seed,
            "valid_fraction": valid_fraction,
        }
        units = tokens.num_docs // 2 if tokens.pairs else tokens.num_docs  # a pair folder splits and packs pairs
        docs = index_lib.cached_arrays(
            cache_dir,
            split_key,
            lambda: {"docs": index_lib.split_documents(units, split, valid_fraction, seed)},
        )["docs"]
        sizes = pair_sizes(tokens.sizes()) if tokens.pairs else tokens.sizes()
        self.samples_per_epoch = index_lib.samples_per_epoch(int(sizes[docs].sum(dtype=np.int64)), seq_len)
        if tokens.chat:
            kept = docs if overlong == "truncate" else docs[sizes[docs] <= seq_len + 1]
            first = np.random.default_rng([seed, 0]).permutation(kept)
            self.samples_per_epoch = pack_epoch(np.minimum(sizes, seq_len + 1), first, seq_len + 1).size - 1
        if self.samples_per_epoch < 1:
            raise DstrainError(
                f"{tokens.folder}: the {split} split holds {int(sizes[docs].sum())} tokens, not enough for one sample "
                f"of seq_len + 1 = {seq_len + 1}; lower seq_len, change valid_fraction, or prepare more data"
            )
        self.num_samples = self.samples_per_epoch if num_samples is None else num_samples
        num_epochs = max(1, math.ceil(self.num_samples / self.samples_per_epoch))
        epochs_key = {**split_key, "kind": "epochs", "seq_len": seq_len, "num_epochs": num_epochs}
        if tokens.chat:
            epochs_key.update(kind="chat epochs", overlong=overlong)
        build = build_chat_epochs if tokens.chat else index_lib.build_epochs
        options = (overlong,) if tokens.chat else ()
        arrays = index_lib.cached_arrays(
            cache_dir, epochs_key, lambda: build(sizes, np.asarray(docs), seq_len, seed, num_epochs, *options)
        )
        self.pad_id = int(tokens.manifest["eos_id"])
        self.epoch_first_doc = np.concatenate([[0], np.cumsum(arrays["epoch_docs"])]) if tokens.chat else None
        self.docs_per_epoch = docs.size
        self.doc_order = arrays["doc_order"]
        self.sample_starts = arrays["sample_starts"]
        self.sample_order = arrays["sample_order"]
        self._arange = np.arange(seq_len + 1, dtype=np.int64)

    def __reduce__(self):
        # DataLoader workers started by spawn reopen the memory maps instead of copying them.
        return (PackedDataset, self._arguments)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        epoch, j = divmod(int(i), self.samples_per_epoch)
        row = epoch * (self.samples_per_epoch + 1) + int(self.sample_order[epoch * self.samples_per_epoch + j])
        (position, offset), (last_position, last_offset) = self.sample_starts[row : row + 2].tolist()
        if self.epoch_first_doc is not None:  # whole conversations, positions [position, last_position)
            base = int(self.epoch_first_doc[epoch])
            conversations = self.doc_order[base + position : base + last_position].tolist()
            if self.tokens.pairs:
                sides = [self.tokens.side(2 * pair + side) for pair in conversations for side in (0, 1)]
                pair_ids = np.full(self.seq_len + 1, -1, dtype=np.int64)
                pair_ids[: len(conversations)] = conversations  # the folder's pair of each of the sample's pairs
                return {**pair_sample(sides, self.seq_len, self.pad_id), "pair_ids": pair_ids}
            pieces = [self.tokens.document(doc) for doc in conversations]
            masks = [self.tokens.document_mask(doc) for doc in conversations]
            return chat_sample(pieces, masks, self.seq_len, self.pad_id)
        base = epoch * self.docs_per_epoch
        docs = self.doc_order[base + position : base + last_position + 1].tolist()
        need = self.seq_len + 1
        pieces = []
        for doc in docs:
            document = self.tokens.document(doc)
            pieces.append(document[offset : offset + need])
            need -= pieces[-1].size
            offset = 0
        positions = self._arange[: self.seq_len]
        if len(pieces) == 1:
            return {"tokens": pieces[0].astype(np.int64), "position_ids": positions.copy()}
        lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
        piece_starts = np.cumsum(lengths) - lengths
        positions = positions - np.repeat(piece_starts, lengths)[: self.seq_len]
        return {"tokens": np.concatenate(pieces, dtype=np.int64, casting="safe"), "position_ids": positions}


class BlendedDataset:
    """Several PackedDatasets interleaved by weight (``index.build_blend``), or by stages (``build_staged_blend``)."""

    def __init__(self, datasets: list[PackedDataset], blend: dict[str, np.ndarray], build_arguments: tuple):
        self.datasets = datasets
        self.source = blend["source"]
        self.sample = blend["sample"]
        self.exhausted = blend.get("exhausted", np.full(len(datasets), -1))  # sample where each source ran out
        self.names = source_names([folder for folder, _ in build_arguments[0]])
        self._build_arguments = build_arguments

    def __reduce__(self):
        return (build_dataset, self._build_arguments)

    def mix(self, start: int, end: int) -> dict[str, float]:
        """Each source's share of samples ``[start, end)``: ``{"mix_<name>": share}``."""
        n = len(self)
        counts = np.bincount(self.source[np.arange(start, end) % n], minlength=len(self.datasets))
        return {f"mix_{name}": float(c) / max(end - start, 1) for name, c in zip(self.names, counts)}

    def __len__(self) -> int:
        return self.source.size

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return self.datasets[int(self.source[i])][int(self.sample[i])]


def _check_arguments(sources, split, seq_len, num_samples, valid_fraction) -> None:
    if not sources:
        raise DstrainError("data sources: the list is empty; name at least one prepared folder")
    for folder, weight in sources:
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise DstrainError(f"data source {folder}: weight {weight!r} must be a number >= 0")
    if not any(weight > 0 for _, weight in sources):
        raise DstrainError("data sources: every weight is 0; give at least one source a positive weight")
    if split not in SPLITS:
        raise DstrainError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
    if seq_len < 1:
        raise DstrainError(f"seq_len {seq_len}: must be at least 1")
    if num_samples is not None and num_samples < 0:
        raise DstrainError(f"num_samples {num_samples}: must be zero or more (or None for one epoch)")
    if not 0 <= valid_fraction < 1:
        raise DstrainError(f"valid_fraction {valid_fraction}: must be in [0, 1)")
    if split == "valid" and valid_fraction == 0:
        raise DstrainError("split 'valid' with valid_fraction 0 is empty; set valid_fraction > 0 (e.g. 0.01)")


def build_dataset(
    sources: list[tuple[str, float]],
    split: str,
    seq_len: int,
    seed: int,
    num_samples: int | None,
    valid_fraction: float,
    cache_dir: str | os.PathLike | None = None,
    stages: list[tuple[int, list[float]]] | None = None,
    max_epochs: list[float | None] | None = None,
    overlong: str = "truncate",
) -> PackedDataset | BlendedDataset:
    """The ``split`` of prepared folders blended by weight; see the module docstring. ``num_samples=None``: exactly
    one epoch of every source. Index arrays are cached in ``FOLDER/index_cache/`` (or ``cache_dir``) and
    memory-mapped. ``stages``: (first sample, weights) of each mixture after the first (``sources``' weights from
    sample 0); ``max_epochs``: per source, the most passes over its split (None: no cap). Both need
    ``num_samples``. ``overlong``: --chat conversations longer than a sample, truncated or dropped (chat_packing)."""
    _check_arguments(sources, split, seq_len, num_samples, valid_fraction)
    prepared = [PreparedTokens(folder) for folder, _ in sources]
    folders = [folder for folder, _ in sources]
    check_same_tokenizer(folders[0], folders[1:], "prepare them with one tokenizer", where="data source ")

    def cache_of(p: PreparedTokens) -> Path:
        return Path(cache_dir) if cache_dir is not None else p.folder / CACHE_DIR_NAME

    def packed(p: PreparedTokens, count: int | None) -> PackedDataset:
        return PackedDataset(p.folder, split, seq_len, seed, count, valid_fraction, cache_of(p), overlong)

    staged = bool(stages) or any(m is not None for m in max_epochs or []) or min(w for _, w in sources) == 0
    if len(prepared) == 1 and not staged:
        return packed(prepared[0], num_samples)
    weights = [float(weight) for _, weight in sources]
    key = {
        "kind": "blend",
        "data": [p.hash for p in prepared],
        "weights": weights,
        "split": split,
        "seq_len": seq_len,
        "seed": seed,
        "valid_fraction": valid_fraction,
        "num_samples": num_samples,
    }
    if staged:
        assert num_samples is not None, "stages and max_epochs need num_samples"
        epochs = [None if m is None else packed(p, None).samples_per_epoch for p, m in zip(prepared, max_epochs or [])]
        blend = _staged_blend(key, cache_of(prepared[0]), num_samples, stages or [], max_epochs or [], epochs)
    elif num_samples is None:
        datasets = [packed(p, None) for p in prepared]
        counts = [len(d) for d in datasets]
        blend = index_lib.cached_arrays(
            cache_of(prepared[0]), key, lambda: index_lib.build_blend(weights, None, counts)
        )
    else:
        blend = index_lib.cached_arrays(cache_of(prepared[0]), key, lambda: index_lib.build_blend(weights, num_samples))
    if staged or num_samples is not None:
        counts = np.bincount(blend["source"], minlength=len(prepared)).tolist()
        datasets = [packed(p, count) for p, count in zip(prepared, counts)]
    arguments = (sources, split, seq_len, seed, num_samples, valid_fraction, cache_dir, stages, max_epochs, overlong)
    return BlendedDataset(datasets, blend, arguments)


def _staged_blend(key: dict, cache: Path, num_samples: int, stages, max_epochs, epoch_samples) -> dict:
    """``index.build_staged_blend`` of the sources' weights then ``stages``, each source capped at ``max_epochs``
    of its ``epoch_samples`` (samples per epoch of its split)."""
    mixtures = [(0, key["weights"]), *stages]
    budgets = [None if m is None else int(m * n) for m, n in zip(max_epochs, epoch_samples)]
    budgets += [None] * (len(key["weights"]) - len(budgets))
    key = {**key, "kind": "staged blend", "stages": mixtures, "budgets": budgets}
    return index_lib.cached_arrays(cache, key, lambda: index_lib.build_staged_blend(mixtures, num_samples, budgets))


def source_names(folders: list[str]) -> list[str]:
    """What logs call each source: its folder's name, or the folder as given where two names coincide."""
    names = [Path(folder).name for folder in folders]
    return names if len(set(names)) == len(names) else [str(folder) for folder in folders]


def build_valid_sets(
    sources: list[tuple[str, float]],
    seq_len: int,
    seed: int,
    valid_fraction: float,
    split: str = "valid",
    **options,
) -> list[tuple[str, float, PackedDataset | BlendedDataset]]:
    """(name, weight, dataset) of each source's whole ``split``: evaluated one by one, whatever the blend;
    ``options``: build_dataset's ``overlong``."""
    names = source_names([folder for folder, _ in sources])
    return [
        (name, float(weight), build_dataset([(folder, 1.0)], split, seq_len, seed, None, valid_fraction, **options))
        for name, (folder, weight) in zip(names, sources)
    ]


def collate(samples: list[dict[str, np.ndarray]]) -> dict:
    """Stack samples into int64 ``input_ids``, ``labels`` (inputs shifted by one; -100, ignored, where a --chat
    sample's loss mask is 0) and ``position_ids``. A text sample in the same batch learns every token."""
    import torch

    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]))
    labels = tokens[:, 1:].clone()
    if any("loss_mask" in s for s in samples):
        learned = np.stack([s.get("loss_mask", np.ones(s["tokens"].size, np.uint8))[1:] for s in samples])
        labels[torch.from_numpy(learned == 0)] = -100
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": labels,
        "position_ids": torch.from_numpy(np.stack([s["position_ids"] for s in samples])),
    }
    if all("documents" in s for s in samples):  # pairs: each label's piece in its sample (data/pair_packing.py)
        batch["documents"] = torch.from_numpy(np.stack([s["documents"][1:] for s in samples]))
    if all("pair_ids" in s for s in samples):  # the folder's pair of each of a sample's pairs, in order; -1 after
        batch["pair_ids"] = torch.from_numpy(np.stack([s["pair_ids"] for s in samples]))
    return batch
