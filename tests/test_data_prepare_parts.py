"""`dstrain prepare` as N tasks plus a merge: the same data as one process, each task resumable on its own."""

from __future__ import annotations

import dataclasses
import gzip
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dstrain.data.shard_writing as prepare_module  # where shards are written
from dstrain.data import prepare_parts
from dstrain.data.dataset import build_dataset
from dstrain.data.manifest import read_manifest
from dstrain.data.prepare import prepare
from dstrain.data.shards import ShardReader
from dstrain.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from dstrain.errors import DstrainError

from data_fixtures import TINY_SHARD_TOKENS, corpus_file

SEQ_LEN = 64


class Killed(BaseException):
    """What a SIGKILL is to the code under test: nothing after it runs (not an Exception any handler takes)."""


def _parts(src: Path, dest: Path, lines_per_part: int) -> str:
    """The corpus as gzip parts of unequal sizes, so files are split by bytes, not count."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    for part, start in enumerate(range(0, len(lines), lines_per_part)):
        with gzip.open(dest / f"part_{part:03d}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines[start : start + lines_per_part])
    return str(dest / "part_*.jsonl.gz")


def _prepare(dataset: str, out: Path, tokenizer: Path, shard_tokens: int = TINY_SHARD_TOKENS, **options) -> dict:
    return prepare(
        dataset, out, tokenizer=str(tokenizer), shard_tokens=shard_tokens, num_proc=1, progress=False, **options
    )


def _run_tasks(dataset: str, out: Path, tokenizer: Path, count: int, **options) -> list[dict]:
    return [_prepare(dataset, out, tokenizer, num_tasks=count, task_index=i, **options) for i in range(count)]


def _stream(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    manifest = read_manifest(folder)
    readers = [ShardReader.open(folder / s.prefix) for s in manifest.shards]
    return np.concatenate([r.tokens for r in readers]), np.concatenate([r.sizes for r in readers])


def _samples(folder: Path, split: str) -> np.ndarray:
    data = build_dataset([(str(folder), 1.0)], split, SEQ_LEN, 7, None, 0.1, cache_dir=folder.parent / "cache")
    return np.stack([data[i]["tokens"] for i in range(len(data))])


def _assert_trains_the_same(merged: Path, single: Path) -> None:
    ours, theirs = (read_manifest(f) for f in (merged, single))
    ignored = {"shards": [], "command": ""}  # the command names its own --out
    assert dataclasses.replace(ours, **ignored) == dataclasses.replace(theirs, **ignored)
    for a, b in zip(_stream(merged), _stream(single)):
        assert np.array_equal(a, b)
    for split in ("train", "valid"):
        assert np.array_equal(_samples(merged, split), _samples(single, split))
    assert not (merged / prepare_parts.TASKS_DIR).exists()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_corpus) -> dict:
    """One jsonl (tasks split it by rows), the same as 12 gzip parts (by files), and their one-process prepares."""
    root = tmp_path_factory.mktemp("task_inputs")
    single_file = str(corpus_file(root))
    parts = _parts(Path(single_file), root / "parts", 25)
    tokenizer = tiny_corpus / "tokenizer"
    one = {kind: root / f"one_{kind}" for kind in ("rows", "files")}
    _prepare(single_file, one["rows"], tokenizer)
    _prepare(parts, one["files"], tokenizer)
    return {"rows": single_file, "files": parts, "one": one, "tokenizer": tokenizer}


@pytest.mark.parametrize("kind", ["rows", "files"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_merged_tasks_train_as_one_process(tmp_path, inputs, kind, count):
    out = tmp_path / "out"
    parts = _run_tasks(inputs[kind], out, inputs["tokenizer"], count)
    if count > 1:
        records = [part.task for part in parts]
        assert all((r.files is not None) == (kind == "files") for r in records)
        ranges = [r.files if kind == "files" else r.rows for r in records]
        assert (
            ranges[0][0] == 0
            and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            and ranges[-1][0] < ranges[-1][1]
        )
    _assert_trains_the_same(out, inputs["one"][kind])


def test_byte_identical_where_shard_boundaries_coincide(tmp_path, inputs):
    """--shard-tokens 1 cuts after every document, so every task boundary is a one-process boundary."""
    single, merged = tmp_path / "single", tmp_path / "out"
    _prepare(inputs["files"], merged, inputs["tokenizer"], shard_tokens=1)
    merged.rename(single)  # the same --out, so that the manifests' commands are the same too
    _run_tasks(inputs["files"], merged, inputs["tokenizer"], 3, shard_tokens=1)

    def files(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    assert files(merged) == files(single)
    assert len(read_manifest(single).shards) == 300


# A `dstrain prepare` task that stalls once its third shard is half written (flushed to the file), so that the test
# can SIGKILL it there: the kernel ends it, nothing of Python's (finally, atexit, buffers) runs.
STALLING_PREPARE = """
import sys, time
import dstrain.data.shard_writing as prepare_module
from dstrain.commands.cli import main

class StallingWriter(prepare_module.ShardWriter):
    def add(self, token_ids, sizes, mask=None):
        super().add(token_ids, sizes, mask)
        if self.bin_path.name.startswith("shard_00002"):
            self._bin.flush()
            print("writing", self._bin_tmp, flush=True)
            time.sleep(600)

prepare_module.ShardWriter = StallingWriter
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.launcher
def test_task_killed_by_sigkill_mid_write_resumes_and_merges_to_the_same_stream(tmp_path, inputs, monkeypatch):
    out, single = tmp_path / "out", tmp_path / "single"
    dataset, tokenizer, shard_tokens = inputs["rows"], inputs["tokenizer"], 4000
    _prepare(dataset, out, tokenizer, shard_tokens=shard_tokens, num_tasks=2, task_index=0)
    argv = ["prepare", "--dataset", dataset, "--tokenizer", str(tokenizer), "--out", str(out)]
    argv += ["--shard-tokens", str(shard_tokens), "--num-proc", "1", "--no-progress", "--num-tasks", "2"]
    task = subprocess.Popen(
        [sys.executable, "-c", STALLING_PREPARE, *argv, "--task-index", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = task.stdout.readline()  # "" if the task ended instead of stalling
    if not line.startswith("writing "):
        task.kill()
        pytest.fail(f"the task never reached its third shard: {line}{task.communicate()[1][-2000:]}")
    os.kill(task.pid, signal.SIGKILL)
    assert task.wait(timeout=60) == -signal.SIGKILL
    task.stdout.close()
    task.stderr.close()
    half_written = Path(line.split(maxsplit=1)[1].strip())
    assert half_written.stat().st_size > 0 and not (out / "manifest.json").exists()
    task0 = prepare_parts.task_folder(out, prepare_parts.TaskSlot(0, 2))
    before = {p.name: p.stat().st_mtime_ns for p in task0.iterdir()}
    started: list[str] = []
    real_writer = prepare_module.ShardWriter

    class CountingWriter(real_writer):
        def __init__(self, prefix, dtype, *masked):
            started.append(Path(prefix).name)
            super().__init__(prefix, dtype, *masked)

    monkeypatch.setattr(prepare_module, "ShardWriter", CountingWriter)
    _prepare(dataset, out, tokenizer, shard_tokens=shard_tokens, num_tasks=2, task_index=0)  # a requeued task 0
    assert started == [] and not (out / "manifest.json").exists()  # done: nothing rewritten, no merge without 1
    assert {p.name: p.stat().st_mtime_ns for p in task0.iterdir()} == before
    _prepare(dataset, out, tokenizer, shard_tokens=shard_tokens, num_tasks=2, task_index=1)  # the requeued task 1
    assert started[0] == "shard_00002"  # its two complete shards were kept, the half-written one redone
    assert (out / "manifest.json").is_file()  # the last task to finish merged
    monkeypatch.setattr(prepare_module, "ShardWriter", real_writer)
    _prepare(dataset, single, tokenizer, shard_tokens=shard_tokens)
    _assert_trains_the_same(out, single)
    assert not list(out.rglob("*.tmp"))


def test_merge_command_waits_for_every_task_and_is_idempotent(tmp_path, inputs):
    out = tmp_path / "out"
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=2)
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=0)
    with pytest.raises(DstrainError, match=r"tasks 1 of 3 have not finished; rerun them \(sbatch --array=1 "):
        prepare_parts.merge(out)
    assert not (out / "manifest.json").exists()
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=1)  # the last one merges
    merged = (out / "manifest.json").read_bytes()
    assert prepare_parts.merge(out) == read_manifest(out) and (out / "manifest.json").read_bytes() == merged
    again = _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=1)  # a late requeue
    assert again == read_manifest(out) and not (out / prepare_parts.TASKS_DIR).exists()
    other = tmp_path / "other_tokenizer"
    save_tokenizer(train_bpe_tokenizer(iter([["a few words of text"] * 10]), 300, 10), other)
    with pytest.raises(DstrainError, match="already holds data prepared from a different tokenizer"):
        _prepare(inputs["files"], out, other, num_tasks=3, task_index=1)
    assert (out / "manifest.json").read_bytes() == merged


def test_interrupted_merge_is_finished_by_the_next(tmp_path, inputs, monkeypatch):
    out = tmp_path / "out"
    moves = []
    real_move = prepare_parts._move

    def dying_move(src, dst):
        if len(moves) == 3:
            raise Killed
        moves.append(dst)
        real_move(src, dst)

    monkeypatch.setattr(prepare_parts, "_move", dying_move)
    with pytest.raises(Killed):
        _run_tasks(inputs["files"], out, inputs["tokenizer"], 2)
    monkeypatch.setattr(prepare_parts, "_move", real_move)
    (out / prepare_parts.TASKS_DIR / prepare_parts.MERGE_LOCK).unlink()  # what the dead merger left
    prepare_parts.merge(out)
    _assert_trains_the_same(out, inputs["one"]["files"])


def test_task_slot_comes_from_the_slurm_array():
    array = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "64"}
    assert prepare_parts.task_slot(None, None, array) == prepare_parts.TaskSlot(5, 64)
    assert prepare_parts.task_slot(None, None, {}) is None
    assert prepare_parts.task_slot(1, 0, array) is None  # one task: a plain prepare
    rerun = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "2"}  # sbatch --array=3,7 --num-tasks 64
    assert prepare_parts.task_slot(64, None, rerun) == prepare_parts.TaskSlot(7, 64)
    with pytest.raises(DstrainError, match=r"SLURM_ARRAY_TASK_ID 64 is outside \[0, 64\); submit --array=0-63"):
        prepare_parts.task_slot(None, None, {"SLURM_ARRAY_TASK_ID": "64", "SLURM_ARRAY_TASK_COUNT": "64"})
    with pytest.raises(DstrainError, match="--num-tasks N and --task-index I together"):
        prepare_parts.task_slot(4, None, {})


def test_split_files_is_contiguous_nonempty_and_balanced():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 1000, size=int(rng.integers(1, 40))).tolist()
        count = int(rng.integers(1, len(sizes) + 1))
        runs = prepare_parts.split_files(sizes, count)
        assert runs[0][0] == 0 and runs[-1][1] == len(sizes) and all(a < b for a, b in runs)
        assert all(x[1] == y[0] for x, y in zip(runs, runs[1:]))
        largest = max(sum(sizes[a:b]) for a, b in runs)
        assert largest <= sum(sizes) / count + 2 * max(sizes)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"train_tokenizer": 512, "num_tasks": 2, "task_index": 0}, "each task would train its own tokenizer"),
        ({"num_tasks": 2, "task_index": 2}, r"--task-index 2 is outside \[0, 2\)"),
        ({"num_tasks": 301, "task_index": 0}, "more tasks than the input's 300 documents"),
        ({"num_tasks": 2, "task_index": 0, "streaming": True}, "2 tasks need at least 2 input files"),
    ],
)
def test_bad_task_options_are_refused_before_any_work(tmp_path, inputs, options, message):
    out = tmp_path / "out"
    kwargs = {"tokenizer": str(inputs["tokenizer"])} if "train_tokenizer" not in options else {}
    with pytest.raises(DstrainError, match=message):
        prepare(inputs["rows"], out, num_proc=1, progress=False, **kwargs, **options)
    assert not out.exists()


def test_tasks_of_another_count_or_options_are_refused(tmp_path, inputs):
    out = tmp_path / "out"
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=0)
    with pytest.raises(DstrainError, match="holds tasks of a 3-task prepare; rerun with --num-tasks 3"):
        _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=2, task_index=0)
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=1, shard_tokens=9999)
    with pytest.raises(DstrainError, match="shard_tokens differs .* the tasks were run with different options"):
        _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=3, task_index=2)
    assert not (out / "manifest.json").exists()


def test_requeued_task_finishes_a_merge_cut_short_after_its_manifest(tmp_path, inputs, monkeypatch):
    out = tmp_path / "out"

    real_rmtree = prepare_parts.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == prepare_parts.TASKS_DIR:
            raise Killed  # the merge, killed once its manifest is written, before it cleans up
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(prepare_parts.shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        _run_tasks(inputs["files"], out, inputs["tokenizer"], 2)
    monkeypatch.undo()
    assert (out / "manifest.json").is_file() and (out / prepare_parts.TASKS_DIR).is_dir()
    monkeypatch.setattr(prepare_module, "ShardWriter", None)  # a requeued task writes no shard: it only merges
    _prepare(inputs["files"], out, inputs["tokenizer"], num_tasks=2, task_index=0)
    assert not (out / prepare_parts.TASKS_DIR).exists()
    _assert_trains_the_same(out, inputs["one"]["files"])
