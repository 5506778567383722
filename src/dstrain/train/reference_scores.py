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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dstrain.errors import DstrainError

SCORES_DIR = "reference_scores"


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


@torch.no_grad()
def score_pairs(
    forward: Callable[[dict], torch.Tensor], datasets: list, num_pairs: int, micro: int, replica: int, replicas: int,
    device: torch.device,
) -> np.ndarray:  # fmt: skip
    """(num_pairs, 4): chosen and rejected completion log-prob sums and their learned tokens, of every pair in
    ``datasets`` (pair folders' PackedDatasets of one epoch: each pair once), ``forward(batch)`` giving the logits;
    NaN for a pair never met (in another split, or a dropped overlong one). A collective where torch.distributed is
    initialised."""
    from dstrain.data.dataset import collate
    from dstrain.train.preference import completion_logps

    sums = torch.zeros(num_pairs, 5, dtype=torch.float64, device=device)  # chosen, rejected, their tokens, times
    for data in datasets:
        mine = list(range(replica, len(data), replicas))
        for start in range(0, len(mine), micro):
            batch = collate([data[i] for i in mine[start : start + micro]])
            batch = {k: v.to(device) for k, v in batch.items()}
            logps = completion_logps(forward(batch), batch["labels"], batch["documents"])
            pairs = batch["pair_ids"][batch["pair_ids"] >= 0]
            rows = torch.stack(
                [
                    logps.chosen,
                    logps.rejected,
                    logps.chosen_tokens,
                    logps.rejected_tokens,
                    torch.ones_like(logps.chosen),
                ],
                1,
            ).double()
            sums.index_add_(0, pairs, rows)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    scores = sums[:, :4].cpu().numpy()
    scores[sums[:, 4].cpu().numpy() == 0] = np.nan
    return scores


def reference_scores(folder: str | os.PathLike, key: str, parts: dict, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The kept scores of ``key``, else ``compute()``'s, kept for every later run on the same inputs."""
    kept = load_scores(folder, key)
    if kept is not None:
        return kept
    scores = compute()
    if (
        not (torch.distributed.is_available() and torch.distributed.is_initialized())
        or torch.distributed.get_rank() == 0
    ):
        store_scores(folder, key, parts, scores)
    return scores
