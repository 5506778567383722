"""The reference model's completion log-prob sums of every pair of a pair folder, computed once and kept beside the
shards: ``FOLDER/reference_scores/<key>.npy`` (float64, one row per pair: chosen, rejected, and their learned
tokens) and ``<key>.json`` (what
the key was made of, and the .npy's size and XXH3-64 checksum), written atomically.

The key is a hash of the reference's weights (``weights_hash``), the data (the manifest's hash, which holds the
chat template's), and the packing that decides which tokens of a pair are scored (seq_len and data.overlong: an
overlong pair is cut by dstrain.data.pair_packing.pair_cut, whatever its neighbours; under document masking its
neighbours change nothing else). Any later run on the same inputs reuses the file; a file whose checksum does not
match is refused in one line. Scoring reads each split's samples once, each data-parallel replica every
``replicas``-th, and adds the replicas' rows up (float64) with one all-reduce.

An interrupted pass resumes: every SAVE_EVERY_S each rank keeps what it has scored so far and how far it got
(``.<key>.partial-<replica>-of-<replicas>.npz``, written atomically), and a later pass under the same number of
replicas goes on from there. Each pair's row is written by exactly one micro-batch, so the resumed scores are the
uninterrupted ones bit for bit. The partial files are removed once the scores are kept; under another number of
replicas the pass starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dstrain.errors import DstrainError

SCORES_DIR = "reference_scores"
SAVE_EVERY_S = 60.0  # how much scoring an interrupted reference pass can lose, per rank


def weights_hash(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 (16 hex digits) of a state dict's names, shapes and fp32 values: the reference's identity."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


def scores_key(weights: str, data: str, seq_len: int, overlong: str) -> tuple[str, dict]:
    """(key, its parts): the file name the scores of these inputs are kept under."""
    parts = {"weights": weights, "data": data, "seq_len": seq_len, "overlong": overlong}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16], parts


def _checksum(path: Path) -> str:
    import xxhash

    return xxhash.xxh3_64(path.read_bytes()).hexdigest()


def load_scores(folder: str | os.PathLike, key: str) -> np.ndarray | None:
    """The kept scores of ``key``, None where there are none; a one-line refusal where they were changed."""
    base = Path(folder) / SCORES_DIR / key
    if not base.with_suffix(".json").is_file():
        return None
    record = json.loads(base.with_suffix(".json").read_text(encoding="utf-8"))
    npy = base.with_suffix(".npy")
    if not npy.is_file() or npy.stat().st_size != record["bytes"] or _checksum(npy) != record["xxh3"]:
        raise DstrainError(
            f"{npy}: the reference scores differ from what {base.with_suffix('.json').name} recorded (size or "
            f"checksum); delete both files to score the pairs again"
        )
    return np.load(npy, allow_pickle=False)


def store_scores(folder: str | os.PathLike, key: str, parts: dict, scores: np.ndarray) -> None:
    """Write the scores, then their record (its presence means the .npy is whole), each atomically."""
    from dstrain.files import write_json_atomic

    directory = Path(folder) / SCORES_DIR
    directory.mkdir(exist_ok=True)
    npy, tmp = directory / f"{key}.npy", directory / f".{key}.npy.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, scores, allow_pickle=False)
    os.replace(tmp, npy)
    record = {**parts, "pairs": int(scores.shape[0]), "bytes": npy.stat().st_size, "xxh3": _checksum(npy)}
    write_json_atomic(directory / f"{key}.json", record)


def _partial_file(partial: Path, replica: int, replicas: int) -> Path:
    return partial.with_name(f"{partial.name}-{replica}-of-{replicas}.npz")


def _resume(partial: Path | None, num_pairs: int, replica: int, replicas: int) -> tuple[torch.Tensor, int]:
    """(the row sums kept by an interrupted pass of this replica, the micro-batches it had scored)."""
    sums = torch.zeros(num_pairs, 5, dtype=torch.float64)  # chosen, rejected, their tokens, times met
    if partial is None or not _partial_file(partial, replica, replicas).is_file():
        return sums, 0
    with np.load(_partial_file(partial, replica, replicas), allow_pickle=False) as kept:
        if kept["sums"].shape != tuple(sums.shape):
            return sums, 0
        return torch.from_numpy(kept["sums"]), int(kept["batches"])


def _keep_partial(partial: Path, sums: torch.Tensor, batches: int, replica: int, replicas: int) -> None:
    path = _partial_file(partial, replica, replicas)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npz")
    np.savez(tmp, sums=sums.cpu().numpy(), batches=np.int64(batches))
    os.replace(tmp, path)


@torch.no_grad()
def score_pairs(
    forward: Callable[[dict], torch.Tensor], datasets: list, num_pairs: int, micro: int, replica: int, replicas: int,
    device: torch.device, partial: Path | None = None, save_every_s: float = SAVE_EVERY_S,
) -> np.ndarray:  # fmt: skip
    """(num_pairs, 4): chosen and rejected completion log-prob sums and their learned tokens, of every pair in
    ``datasets`` (pair folders' PackedDatasets of one epoch: each pair once), ``forward(batch)`` giving the logits;
    NaN for a pair never met (in another split, or a dropped overlong one). ``partial``: where this pass keeps its
    progress and resumes an interrupted one from (module doc). A collective where torch.distributed is initialised."""
    from dstrain.data.dataset import collate
    from dstrain.train.preference import completion_logps

    kept, done = _resume(partial, num_pairs, replica, replicas)
    sums, batches, last_kept = kept.to(device), 0, time.monotonic()
    for data in datasets:
        mine = list(range(replica, len(data), replicas))
        for start in range(0, len(mine), micro):
            batches += 1
            if batches <= done:
                continue
            batch = collate([data[i] for i in mine[start : start + micro]])
            batch = {k: v.to(device) for k, v in batch.items()}
            logps = completion_logps(forward(batch), batch["labels"], batch["documents"])
            pairs = batch["pair_ids"][batch["pair_ids"] >= 0]
            rows = torch.stack(
                [logps.chosen, logps.rejected, logps.chosen_tokens, logps.rejected_tokens,
                 torch.ones_like(logps.chosen)], 1
            ).double()  # fmt: skip
            sums.index_add_(0, pairs, rows)
            if partial is not None and time.monotonic() - last_kept >= save_every_s:
                _keep_partial(partial, sums, batches, replica, replicas)
                last_kept = time.monotonic()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    scores = sums[:, :4].cpu().numpy()
    scores[sums[:, 4].cpu().numpy() == 0] = np.nan
    return scores


def reference_scores(
    folder: str | os.PathLike, key: str, parts: dict, compute: Callable[[Path], np.ndarray]
) -> np.ndarray:
    """The kept scores of ``key``, else ``compute(partial)``'s (``partial``: score_pairs'), kept for every later run
    on the same inputs."""
    kept = load_scores(folder, key)
    if kept is not None:
        return kept
    directory = Path(folder) / SCORES_DIR
    directory.mkdir(exist_ok=True)
    scores = compute(directory / f".{key}.partial")
    if (
        not (torch.distributed.is_available() and torch.distributed.is_initialized())
        or torch.distributed.get_rank() == 0
    ):  # every rank is past compute's all-reduce: no partial file is written any more
        store_scores(folder, key, parts, scores)
        for path in directory.glob(f".{key}.partial-*"):
            path.unlink(missing_ok=True)
    return scores
