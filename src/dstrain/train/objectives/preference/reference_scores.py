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

An interrupted pass resumes: every SAVE_EVERY_S the ranks add up the rows they have scored so far and rank 0 keeps
them with how far the replicas got (``.<key>.partial-<replicas>x<micro>.npz``, written atomically), and a later pass
of the same layout goes on from there. Each pair's row is written by exactly one micro-batch, so the resumed scores
are the uninterrupted ones bit for bit. The partial file is removed once the scores are kept; under another number
of replicas or micro-batch size the pass starts over.
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
from dstrain.train.objectives.preference.losses import PairLogps

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


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank0() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0


def _partial_file(partial: Path, replicas: int, micro: int) -> Path:
    return partial.with_name(f"{partial.name}-{replicas}x{micro}.npz")


def _resume(partial: Path | None, num_pairs: int, replicas: int, micro: int, device) -> tuple[torch.Tensor, int]:
    """(this rank's starting row sums, the micro-batches every replica had scored): rank 0 holds the kept rows of an
    interrupted pass of this layout, the other ranks none."""
    sums = torch.zeros(num_pairs, 5, dtype=torch.float64, device=device)  # chosen, rejected, their tokens, times
    done = torch.zeros(1, dtype=torch.float64, device=device)
    path = None if partial is None else _partial_file(partial, replicas, micro)
    if path is not None and _rank0() and path.is_file():
        with np.load(path, allow_pickle=False) as kept:
            if kept["sums"].shape == tuple(sums.shape):
                sums.copy_(torch.from_numpy(kept["sums"]))
                done += float(kept["batches"])
    if path is not None and _distributed():
        torch.distributed.all_reduce(done)  # rank 0's count, to every rank
    return sums, int(done.item())


def _keep_progress(partial: Path, sums: torch.Tensor, batches: int, replicas: int, micro: int) -> None:
    """Every rank's rows so far added up, and the count of micro-batches each replica has scored, written by rank 0
    atomically: a collective, and so a point every rank has reached."""
    rows = sums.clone()
    if _distributed():
        torch.distributed.all_reduce(rows)
    if _rank0():
        path = _partial_file(partial, replicas, micro)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npz")
        np.savez(tmp, sums=rows.cpu().numpy(), batches=np.int64(batches))
        os.replace(tmp, path)


def _due(last_kept: float, save_every_s: float, device) -> bool:
    """Whether rank 0 says it is time to keep the progress (one scalar all-reduce: every rank decides alike)."""
    due = torch.tensor([float(time.monotonic() - last_kept >= save_every_s)], device=device)
    if _distributed():
        torch.distributed.all_reduce(due, op=torch.distributed.ReduceOp.MAX)
    return bool(due.item())


@torch.no_grad()
def score_pairs(
    logps_of: Callable[[dict], PairLogps], datasets: list, num_pairs: int, micro: int, replica: int, replicas: int,
    device: torch.device, partial: Path | None = None, save_every_s: float = SAVE_EVERY_S, adds: bool = True,
) -> np.ndarray:  # fmt: skip
    """(num_pairs, 4): chosen and rejected completion log-prob sums and their learned tokens, of every pair in
    ``datasets`` (pair folders' PackedDatasets of one epoch: each pair once), ``logps_of(batch)`` giving a
    micro-batch's PairLogps; NaN for a pair never met (in another split, or a dropped overlong one). Replica r of
    ``replicas`` takes every replicas-th sample; every replica runs as many forwards (the last ones of a shorter share
    score a filler sample and keep nothing), so that a forward that is a collective (ZeRO-3, TP, SP) meets its
    partners. ``adds``: whether this rank's rows count (one rank of each replica). ``partial``: where this pass keeps
    its progress and resumes an interrupted one from (module doc). A collective where torch.distributed is
    initialised."""
    from dstrain.data.dataset import collate

    sums, done = _resume(partial, num_pairs, replicas, micro, device)
    batches, last_kept = 0, time.monotonic()
    for data in datasets:
        mine = list(range(replica, len(data), replicas))
        for start in range(0, -(-len(data) // replicas), micro):
            batches += 1
            if batches <= done:
                continue
            samples = mine[start : start + micro]
            batch = collate([data[i] for i in samples or [0]])
            batch = {k: v.to(device) for k, v in batch.items()}
            logps = logps_of(batch)
            if samples and adds:
                pairs = batch["pair_ids"][batch["pair_ids"] >= 0]
                rows = torch.stack(
                    [logps.chosen, logps.rejected, logps.chosen_tokens, logps.rejected_tokens,
                     torch.ones_like(logps.chosen)], 1
                ).double()  # fmt: skip
                sums.index_add_(0, pairs, rows)
            if partial is not None and _due(last_kept, save_every_s, device):
                _keep_progress(partial, sums, batches, replicas, micro)
                last_kept = time.monotonic()
    if _distributed():
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
    if _rank0():  # every rank is past compute's all-reduce: no partial file is written any more
        store_scores(folder, key, parts, scores)
        for path in directory.glob(f".{key}.partial-*"):
            path.unlink(missing_ok=True)
    return scores
