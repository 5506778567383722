"""Checksums of every checkpoint file, taken while it is written, and the check of a tag against its record.

Sizes alone miss a file damaged in place (a bad disk, a partial copy between filesystems, silent corruption at
scale). Each rank hashes the bytes of every file it saves as they go to disk (``ChecksummedEngine``, DeepSpeed's
checkpoint-engine interface: no second read), in the background thread for background saves, and leaves them in
``<tag>.partial/dstrain_sums.rank<r>.json``; rank 0 adds them to the record beside the sizes at publication, and
hashes there the few files DeepSpeed writes outside the checkpoint engine (zero_to_fp32.py, NVMe swap-file copies).

The hash is xxHash's XXH3-64 (the ``xxhash`` package): not cryptographic (a checksum catches damage, not an
adversary; ``safe_load`` is what keeps a crafted file from running code), and fast: bench/bench_checkpoint.py
measures its cost against a save.

A disk that fills during a write is caught here too: the failing write is recorded (``ChecksummedEngine.disk_full``)
and DeepSpeed's save carries on to its barriers, so that every rank reaches the agreement in store.save.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import IO, cast

import xxhash
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from dstrain.checkpoint import safe_load
from dstrain.checkpoint.record import CheckpointRecord

HASH = "xxh3_64"
SUMS = "dstrain_sums.rank{}.json"  # one per rank in a .partial folder, folded into the record at publication
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
CHUNK = 1 << 22


class HashingFile:
    """A file opened for writing that hashes what goes through it."""

    def __init__(self, path: str):
        self.file = open(path, "wb")  # noqa: SIM115  (closed by close(), which the engine always calls)
        self.hash = xxhash.xxh3_64()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def open_for_write(path: str) -> HashingFile:
    """Where every checkpoint file of ours is opened: a test injects a full disk by replacing this."""
    return HashingFile(path)


class ChecksummedEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, with a checksum of each file saved (``sums``: path -> hex digest), loads
    through ``safe_load``, and a full disk recorded (``disk_full``: the OSError) instead of raised."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.sums: dict[str, str] = {}
        self.disk_full: OSError | None = None

    def save(self, state_dict, path: str) -> None:
        self.write(state_dict, path)

    def write(self, state_dict, path: str) -> None:
        import torch

        if self.disk_full is not None:
            return  # the first full write stops this rank's save; the partial tag is dropped
        try:
            out = open_for_write(path)
            try:
                torch.save(state_dict, cast(IO[bytes], out), _use_new_zipfile_serialization=self.zipfile_serialization)
            finally:
                out.close()
        except (OSError, RuntimeError) as e:
            cause = disk_full_cause(e)
            if cause is None:
                raise
            self.disk_full = cause
            Path(path).unlink(missing_ok=True)
            return
        self.sums[path] = out.hash.hexdigest()

    def load(self, path: str, map_location=None):
        return safe_load.load(path, map_location=map_location)

    def write_sums(self, folder: Path, rank: int) -> None:
        """This rank's checksums, relative to ``folder`` (the tag's .partial folder)."""
        sums = {str(Path(p).relative_to(folder)): h for p, h in self.sums.items()}
        try:
            (folder / SUMS.format(rank)).write_text(json.dumps(sums))
        except OSError as e:
            if disk_full_cause(e) is None:
                raise
            self.disk_full = e


def disk_full_cause(error: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT behind ``error``: itself, its cause, or torch's RuntimeError around a failed write."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL:
            return seen
        if isinstance(seen, shutil.Error):  # copytree's: each copy's error as (src, dst, text), the errno only in it
            for _, dst, text in seen.args[0]:
                full = next((n for n in DISK_FULL if str(text).startswith(f"[Errno {n}]")), None)
                if full is not None:
                    return OSError(full, os.strerror(full), dst)
        seen = seen.__cause__ or seen.__context__
    return None


def file_checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def collect_sums(folder: Path, files: list[str]) -> dict[str, str]:
    """Rank 0 at publication: every rank's checksums (their files removed), plus its own hash of each file in
    ``files`` that no rank's checkpoint engine wrote."""
    sums: dict[str, str] = {}
    for part in sorted(folder.glob(SUMS.format("*"))):
        sums.update(json.loads(part.read_text()))
        part.unlink()
    for name in files:
        if name not in sums:
            sums[name] = file_checksum(folder / name)
    return sums


def damage(tag_dir: Path, record: CheckpointRecord) -> str | None:
    """What is wrong with ``tag_dir``'s files against its record, in one phrase naming the file; None if intact.
    Reads every file once (checksums are verified where the record has them)."""
    sums = record.checksums
    for name, size in record.files.items():
        path = tag_dir / name
        try:
            found = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if found != size:
            return f"{path} holds {found} bytes, its record says {size}"
        if name in sums and (digest := file_checksum(path)) != sums[name]:
            return f"{path} has checksum {digest}, its record says {sums[name]} (damaged in place)"
    return None


def check_pickles(tag_dir: Path, record: CheckpointRecord) -> None:
    """Every ``.pt`` of the record unpickles under safe_load's rules (structure only): else UnsafeCheckpoint."""
    for name in record.files:
        if name.endswith(".pt"):
            safe_load.loads_safely(tag_dir / name)


def free_space_line(folder: Path, needed: int, error: OSError | None) -> str:
    """One line for a checkpoint that did not fit: the filesystem, its free space and what a checkpoint needs."""
    mount = folder
    while not mount.exists() or (not os.path.ismount(mount) and mount != mount.parent):
        mount = mount.parent
    free = shutil.disk_usage(folder if folder.exists() else mount).free
    why = os.strerror(error.errno if error is not None and error.errno else errno.ENOSPC)
    return (
        f"{folder}: the filesystem mounted at {mount} is full ({why}): {free / 2**30:.2f} GiB "
        f"free, a checkpoint needs ~{needed / 2**30:.2f} GiB; the partial checkpoint was removed and `latest` is "
        f"untouched: free space (or move run_dir to a larger filesystem), then relaunch to resume"
    )
