"""``dstrain prepare`` across the nodes of a cluster: N tasks, each a deterministic part, then one merge.

OUT/tasks/00003-of-00064/   task 3's part: a complete prepared folder of its own (tokenizer/,
                            prepare_inputs.json, shard_*.bin/.idx, manifest.json written last),
                            resumable on its own exactly as a one-process prepare is
OUT/shard_*, manifest.json  after the merge: what a one-process prepare of the whole input writes

Task t takes a contiguous run of the documents in the one-process order: files ``[a_t, b_t)`` of
the input's file list when there are at least as many files as tasks (balanced by bytes, each task
opening and hashing only its own files), else rows ``[t*n/N, (t+1)*n/N)``. The merge renames the
tasks' shards, in task order, to ``shard_00000, shard_00001, ...``, so the merged folder holds the
same documents, in the same order, with the same token stream as one process would write; where
the shard boundaries coincide (every task boundary is one of one process's shard boundaries) the
shards and manifest are byte-identical too. A file's hash is its own, and the input's fingerprint
is the hash of the files' hashes in order (``sources.combine_digests``), so the merged fingerprint
is the one-process one.

The merge is idempotent and safe to race: every step is a rename that a second merger either
repeats or finds done, and ``manifest.json`` is written last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dstrain.data.manifest import (
    INPUTS_NAME,
    MANIFEST_NAME,
    Manifest,
    PairsRecord,
    ShardRecord,
    read_manifest,
    write_manifest,
)
from dstrain.data.pairs import pair_counts
from dstrain.data.shard_writing import chat_counts
from dstrain.data.shards import SHARD_NAME, ShardReader, mask_prefix, shard_paths
from dstrain.data.sources import (
    Source,
    SourceSpec,
    combine_digests,
    local_files,
    open_chat_source,
    open_files,
    open_source,
)
from dstrain.data.tokenizer import TOKENIZER_DIR
from dstrain.errors import DstrainError
from dstrain.files import write_json_atomic

TASKS_DIR = "tasks"
_TASK_NAME = "{:05d}-of-{:05d}"
_TASK_PATTERN = re.compile(r"^(\d{5})-of-(\d{5})$")
MERGE_LOCK = "merge.lock"
# Keys of a task's manifest that describe its part only; every other key must agree between tasks.
# ("command" is spelled by each task; what it says is in the other keys.)


@dataclass(frozen=True)
class TaskSlot:
    """Which part of the input this process prepares: task ``index`` of ``count``."""

    index: int
    count: int

    @property
    def name(self) -> str:
        return _TASK_NAME.format(self.index, self.count)


def task_slot(num_tasks: int | None, task_index: int | None, environ: Mapping[str, str]) -> TaskSlot | None:
    """``--num-tasks``/``--task-index``, each defaulting to the Slurm array's; None for a one-process prepare.

    The index is ``SLURM_ARRAY_TASK_ID`` itself (submit ``--array=0-<N-1>``), so a rerun of some tasks
    (``--array=3,7``) keeps its indices; pass ``--num-tasks N`` there, since that array's count is 2.
    """
    array_id, array_count = environ.get("SLURM_ARRAY_TASK_ID"), environ.get("SLURM_ARRAY_TASK_COUNT")
    from_array = num_tasks is None and task_index is None and array_id is not None
    if num_tasks is None and array_count is not None and array_id is not None:
        num_tasks = int(array_count)
    if task_index is None and array_id is not None and num_tasks is not None:
        task_index = int(array_id)
    if num_tasks is None and task_index is None:
        return None
    if num_tasks is None or task_index is None:
        raise DstrainError("dstrain prepare: pass --num-tasks N and --task-index I together (or run in a Slurm array)")
    if num_tasks < 1:
        raise DstrainError(f"--num-tasks {num_tasks}: must be at least 1")
    if not 0 <= task_index < num_tasks:
        where = "SLURM_ARRAY_TASK_ID" if from_array else "--task-index"
        raise DstrainError(
            f"{where} {task_index} is outside [0, {num_tasks}); submit --array=0-{num_tasks - 1} "
            f"or pass --num-tasks with the whole job's task count"
        )
    return TaskSlot(task_index, num_tasks) if num_tasks > 1 else None


def task_folder(out: Path, slot: TaskSlot) -> Path:
    return out / TASKS_DIR / slot.name


def split_files(sizes: list[int], count: int) -> list[tuple[int, int]]:
    """``count`` contiguous, non-empty runs ``[a, b)`` of files, about equal in bytes (needs len >= count)."""
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.float64)])[:-1]
    total = float(sum(sizes))
    bounds = [0]
    for t in range(1, count):
        cut = int(np.searchsorted(starts, t * total / count, side="left"))
        bounds.append(min(max(cut, bounds[-1] + 1), len(sizes) - (count - t)))
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


def row_range(num_docs: int, slot: TaskSlot) -> tuple[int, int]:
    return slot.index * num_docs // slot.count, (slot.index + 1) * num_docs // slot.count


def open_part(spec: SourceSpec, slot: TaskSlot, chat: bool = False) -> tuple[Source, dict[str, Any]]:
    """This task's part of the input (``chat``: its conversations), and the record of it kept in the task's
    manifest."""
    files = local_files(spec)
    if files is not None and len(files) >= slot.count:
        a, b = split_files([os.path.getsize(f) for f in files], slot.count)[slot.index]
        source, digests = open_chat_source(spec, files[a:b]) if chat else open_files(spec, files[a:b])
        return source, {"index": slot.index, "count": slot.count, "files": [a, b], "file_digests": digests}
    source = open_chat_source(spec)[0] if chat else open_source(spec)
    if source.num_docs is None:
        raise DstrainError(
            f"--dataset {spec.dataset!r} --streaming: {slot.count} tasks need at least {slot.count} input files "
            f"to split a stream ({len(files or [])} given); drop --streaming (tasks then split by rows) "
            f"or split the input into more files"
        )
    if source.num_docs < slot.count:
        raise DstrainError(f"--num-tasks {slot.count}: more tasks than the input's {source.num_docs} documents")
    a, b = row_range(source.num_docs, slot)
    source.rows, source.num_docs = source.rows.select(range(a, b)), b - a
    return source, {"index": slot.index, "count": slot.count, "rows": [a, b]}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _task_folders(out: Path) -> dict[int, tuple[int, Path]]:
    """{index: (count, folder)} of every task folder under ``out/tasks``."""
    found = {}
    for folder in sorted((out / TASKS_DIR).iterdir()) if (out / TASKS_DIR).is_dir() else []:
        if match := _TASK_PATTERN.match(folder.name):
            found[int(match[1])] = (int(match[2]), folder)
    return found


def check_layout(out: Path, slot: TaskSlot) -> None:
    """Refuse an ``out`` that holds a one-process prepare or tasks of another task count."""
    unfinished = (out / INPUTS_NAME).is_file() and not (out / MANIFEST_NAME).is_file()
    if unfinished and not (out / TASKS_DIR).is_dir():
        raise DstrainError(
            f"--out {out} holds an unfinished one-process prepare; finish it without --num-tasks, "
            f"or choose another --out (nothing was changed)"
        )
    others = {count for count, _ in _task_folders(out).values() if count != slot.count}
    if others:
        raise DstrainError(
            f"--out {out} holds tasks of a {min(others)}-task prepare; rerun with --num-tasks {min(others)} "
            f"or choose another --out (nothing was changed)"
        )


def missing_tasks(out: Path, count: int) -> list[int]:
    """Tasks of ``count`` whose part is not finished (no manifest.json in their folder)."""
    folders = _task_folders(out)
    return [i for i in range(count) if i not in folders or not (folders[i][1] / MANIFEST_NAME).is_file()]


def merge_if_last(out: Path, count: int) -> Manifest | None:
    """Called by a task once its part is done: the task that finds every part done merges
    (one of them, by an exclusive lock file); None if some are still running."""
    if missing_tasks(out, count):
        return None
    try:
        os.close(os.open(out / TASKS_DIR / MERGE_LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None  # another task is merging; `dstrain prepare --merge` finishes it if that one dies
    except FileNotFoundError:
        return _merged(out)  # merged and cleaned up meanwhile
    return merge(out)


def _merged(out: Path) -> Manifest | None:
    if not (out / MANIFEST_NAME).is_file() or (out / TASKS_DIR).exists():
        return None
    return read_manifest(out)


def _task_manifests(out: Path) -> list[tuple[Path, Manifest]]:
    folders = _task_folders(out)
    counts = {count for count, _ in folders.values()}
    if len(counts) != 1:
        what = "no task folders" if not counts else f"tasks of several counts ({sorted(counts)})"
        raise DstrainError(f"dstrain prepare --merge {out}: {out / TASKS_DIR} holds {what}; run the tasks first")
    count = counts.pop()
    if missing := missing_tasks(out, count):
        listed = ",".join(map(str, missing[:20])) + ("..." if len(missing) > 20 else "")
        raise DstrainError(
            f"dstrain prepare --merge {out}: tasks {listed} of {count} have not finished; rerun them "
            f"(sbatch --array={listed} slurm/prepare.sbatch --num-tasks {count} ...), then merge"
        )
    result = []
    for index in range(count):
        folder = folders[index][1]
        try:
            manifest = read_manifest(folder)
        except DstrainError as e:
            raise DstrainError(f"{e}; or rerun task {index}, then merge") from None
        result.append((folder, manifest))
    return result


def _check_agreement(parts: list[tuple[Path, Manifest]]) -> None:
    def shared(manifest: Manifest) -> Manifest:
        """What every task's part has alike: not its shards, counts, task, content fingerprint or command line."""
        chat = manifest.chat and dataclasses.replace(manifest.chat, learned_tokens=0, longest=0, longer_than={})
        pairs = manifest.pairs and PairsRecord(pairs=0, longest=0, longer_than={})  # each part's own counts
        source = dataclasses.replace(manifest.source, fingerprint=None)
        return dataclasses.replace(
            manifest, shards=[], documents=0, tokens=0, task=None, source=source, command="", chat=chat, pairs=pairs
        )

    first_folder, first = parts[0]
    for folder, manifest in parts[1:]:
        theirs, ours = shared(manifest), shared(first)
        for key in [f.name for f in dataclasses.fields(Manifest) if f.compare]:
            if getattr(theirs, key) != getattr(ours, key):
                raise DstrainError(
                    f"{folder / MANIFEST_NAME}: {key} differs from {first_folder / MANIFEST_NAME}'s; "
                    f"the tasks were run with different options: rerun them with one set, then merge"
                )


def _move(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; done already (by an earlier or a concurrent merge) if only ``dst`` exists."""
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        if not dst.exists():
            raise DstrainError(f"{src}: missing; rerun its task, then merge") from None


def merge(out: str | os.PathLike) -> Manifest:
    """One manifest over every task's shards (``dstrain prepare --merge OUT``); returns it."""
    out = Path(out)
    if (done := _merged(out)) is not None:
        return done
    parts = _task_manifests(out)
    _check_agreement(parts)
    records = [manifest.task for _, manifest in parts]
    fingerprint: str | None
    if records[0] is not None and records[0].file_digests is not None:  # tasks of files: their digests combined
        fingerprint = combine_digests([d for record in records if record for d in record.file_digests or []])
    else:
        fingerprint = parts[0][1].source.fingerprint
        for folder, manifest in parts[1:]:
            if manifest.source.fingerprint != fingerprint:
                raise DstrainError(
                    f"{folder / MANIFEST_NAME}: prepared from other content than {parts[0][0] / MANIFEST_NAME} "
                    f"(the input changed while the tasks ran); rerun every task into a new --out"
                )
    shards: list[ShardRecord] = []
    for folder, manifest in parts:
        for shard in manifest.shards:
            name = SHARD_NAME.format(len(shards))
            pairs = list(zip(shard_paths(folder / shard.prefix), shard_paths(out / name)))
            if manifest.masked:  # the mask first: a shard whose .idx is in place has its mask
                pairs[:0] = zip(shard_paths(mask_prefix(folder / shard.prefix)), shard_paths(mask_prefix(out / name)))
            for src, dst in pairs:
                _move(src, dst)  # .bin first, .idx last: a shard whose .idx is in place is whole
            shards.append(dataclasses.replace(shard, prefix=name))
    for shard in shards:
        ShardReader.open(out / shard.prefix)  # every moved shard is whole
    if not (out / TOKENIZER_DIR).is_dir():
        _move(parts[0][0] / TOKENIZER_DIR, out / TOKENIZER_DIR)
    inputs = _read_json(parts[0][0] / INPUTS_NAME)
    if inputs is None:
        raise DstrainError(f"{parts[0][0] / INPUTS_NAME}: unreadable; rerun task 0, then merge")
    inputs.pop("task", None)
    inputs["source"] = {**inputs["source"], "fingerprint": fingerprint}
    write_json_atomic(out / INPUTS_NAME, inputs)
    first = parts[0][1]
    prefixes = [s.prefix for s in shards]
    chat = first.chat and dataclasses.replace(first.chat, **chat_counts(out, prefixes))
    pairs_record = first.pairs and PairsRecord(**pair_counts(out, prefixes))
    merged = dataclasses.replace(
        first,
        source=dataclasses.replace(first.source, fingerprint=fingerprint),
        shards=shards,
        documents=sum(m.documents for _, m in parts),
        tokens=sum(m.tokens for _, m in parts),
        chat=chat,
        pairs=pairs_record,
        task=None,
    )
    manifest = write_manifest(out, merged)
    shutil.rmtree(out / TASKS_DIR, ignore_errors=True)
    return manifest
