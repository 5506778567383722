"""Checkpoints in DeepSpeed's layout, published atomically.

DeepSpeed writes each tag folder in place and then its `latest` file, so a job killed
mid-save can leave a partial folder behind. We save under `<tag>.partial`, record every
file's size and checksum in `dstrain_checkpoint.json` (dstrain.checkpoint.integrity), rename the folder to `<tag>`
and only then replace `latest`: a published tag is always complete, and at resume a tag whose files no
longer match its record (truncated, deleted, damaged in place) is skipped with a one-line warning that names the file.
A save that fills the disk on any rank is dropped on every rank (``DiskFull``): `latest` and the published tags stay.

The record also numbers the saves of a run folder (``save_seq``): keep-last prunes and a resume
without a usable ``latest`` picks in that order, so a tag left by a longer branch never outranks the
checkpoint just written.

Each checkpoint also records the topology it was saved under (ZeRO stage, world, data-parallel,
tensor-parallel and pipeline sizes, precision) and DeepSpeed's universal-checkpoint info, so that a run
can resume under another one (dstrain.checkpoint.reshard).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from dstrain.checkpoint import cpu_adam_steps, integrity, nvme, reshard, safe_load
from dstrain.checkpoint.record import PARTIAL, RECORD, CheckpointRecord, ClientState, Identity, read_record
from dstrain.errors import DiskFull, DstrainError, warn
from dstrain.files import write_text_atomic
from dstrain.run_dir import LATEST, TAG, tag_for
from dstrain.strategy.topology import Topology


def rng_state() -> dict:
    """Tensors, ints and tuples only, so that the checkpoint's client state loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.array(keys)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def published_tags(checkpoint_dir: Path) -> list[str]:
    """Published tags, oldest save first (tags whose record is unreadable first, by step)."""
    if not checkpoint_dir.is_dir():
        return []
    steps = {p.name: int(m.group(1)) for p in checkpoint_dir.iterdir() if p.is_dir() and (m := TAG.match(p.name))}
    return sorted(steps, key=lambda t: (save_seq(checkpoint_dir / t), steps[t]))


def save_seq(tag_dir: Path) -> int:
    record = read_record(tag_dir)
    return record.save_seq if record else -1


def is_complete(tag_dir: Path) -> bool:
    return damage(tag_dir) is None


def damage(tag_dir: Path) -> str | None:
    """What is wrong with a published tag, in one phrase naming the file (None: every file matches its record's
    size and checksum). Reads the whole tag once."""
    record = read_record(tag_dir)
    if record is None:
        return f"{tag_dir / RECORD} is missing or unreadable"
    return integrity.damage(tag_dir, record)


def check_loadable(tag_dir: Path) -> None:
    """Before any work: each .pt file of the tag unpickles without running code, else one line (UnsafeCheckpoint)."""
    record = read_record(tag_dir)
    if record is not None:
        integrity.check_pickles(tag_dir, record)


def newest_complete(checkpoint_dir: Path) -> str | None:
    """The tag ``latest`` names when it is intact, else the most recently saved intact one; a damaged one is
    reported in one line (the file, expected against found) and passed over."""
    try:
        latest = (checkpoint_dir / LATEST).read_text().strip()
    except OSError:
        latest = None
    tags = published_tags(checkpoint_dir)
    if latest and TAG.match(latest) and latest in tags:
        tags = [t for t in tags if t != latest] + [latest]
    for tag in reversed(tags):
        problem = damage(checkpoint_dir / tag)
        if problem is None:
            return tag
        warn(f"checkpoint {checkpoint_dir / tag} is damaged, skipping it: {problem}")
    return None


def newest_intact_other_than(checkpoint_dir: Path, tag: str) -> str | None:
    """For a refusal's fix: the newest intact tag that is not ``tag`` (quietly)."""
    for other in reversed(published_tags(checkpoint_dir)):
        if other != tag and damage(checkpoint_dir / other) is None:
            return other
    return None


def save(
    engine,
    checkpoint_dir: Path,
    step: int,
    client_state: ClientState,
    keep_last: int,
    identity: Identity | None = None,
    rank_files: dict | None = None,
) -> str:
    """Save on every rank, publish on rank 0, then drop the oldest saves beyond ``keep_last``, never this one.

    ``identity`` (what makes the checkpoint meaningless for another experiment) goes into the record, where a
    resume compares it with its recipe before writing anything. A full disk on any rank: DiskFull on every rank.
    ``rank_files``: {file name: state} this rank adds to the tag beside DeepSpeed's (the weight average)."""
    tag = tag_for(step)
    saved, topology = prepare(engine, checkpoint_dir, tag, client_state)
    writer = integrity.ChecksummedEngine(engine._config)
    write_partial(engine, checkpoint_dir, tag, saved, writer, rank_files)
    writer.write_sums(checkpoint_dir / (tag + PARTIAL), torch.distributed.get_rank())
    agree_written(engine, checkpoint_dir, tag, writer.disk_full)  # every rank's shards are on disk
    publish(checkpoint_dir, step, topology, keep_last, identity)
    torch.distributed.barrier()
    return tag


def write_partial(
    engine, checkpoint_dir: Path, tag: str, client_state: dict, writer, rank_files: dict | None = None
) -> None:
    """This rank's files of ``tag`` into its ``.partial`` folder, through ``writer`` (a ChecksummedEngine, which
    hashes them, or background.SnapshotEngine, which queues them) as the engine's checkpoint engine; then
    ``rank_files`` ({file name: state}) through the same writer, so they are checksummed and recorded alike."""
    saved, engine.checkpoint_engine = engine.checkpoint_engine, writer
    try:
        engine.save_checkpoint(str(checkpoint_dir), tag=tag + PARTIAL, client_state=client_state, save_latest=False)
    except OSError as e:  # an NVMe run's swap files, copied past the writer (nvme.finish_save_after_failed_copy)
        writer.disk_full = integrity.disk_full_cause(e)
        if writer.disk_full is None or not engine.zero_nvme_offload_optimizer():
            raise
        nvme.finish_save_after_failed_copy(engine)
    finally:
        engine.checkpoint_engine = saved
    folder = checkpoint_dir / (tag + PARTIAL)
    for name, state in (rank_files or {}).items():
        folder.mkdir(parents=True, exist_ok=True)
        writer.save(state, str(folder / name))  # a full disk: recorded by the writer, like DeepSpeed's files
    if engine.zero_nvme_offload_optimizer() and writer.disk_full is None:
        try:
            nvme.record_subgroups(engine, folder)
        except OSError as e:
            writer.disk_full = integrity.disk_full_cause(e)
            if writer.disk_full is None:
                raise


def agree_written(engine, checkpoint_dir: Path, tag: str, disk_full: OSError | None) -> None:
    """Every rank, after writing its files of ``tag``: a collective that tells each rank whether any filled its
    disk; if one did, rank 0 removes the partial tag and every rank raises DiskFull (one line, no traceback)."""
    from deepspeed.accelerator import get_accelerator

    flag = torch.tensor([1.0 if disk_full is not None else 0.0], device=get_accelerator().current_device_name())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() == 0:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(checkpoint_dir / (tag + PARTIAL), ignore_errors=True)
    torch.distributed.barrier()
    raise DiskFull(integrity.free_space_line(checkpoint_dir, checkpoint_bytes(engine, checkpoint_dir), disk_full))


def checkpoint_bytes(engine, checkpoint_dir: Path) -> int:
    """What a checkpoint takes: the newest published one's size, else 16 bytes per parameter (fp32 weights and
    master, Adam's two moments)."""
    tags = published_tags(checkpoint_dir)
    record = read_record(checkpoint_dir / tags[-1]) if tags else None
    if record is not None and record.files:
        return sum(record.files.values())
    return 16 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())


def prepare(engine, checkpoint_dir: Path, tag: str, client_state: ClientState) -> tuple[dict, Topology]:
    """Every rank, before a save of ``tag``: (the client state as DeepSpeed saves it, with the topology and DeepSpeed's
    universal-checkpoint info added; the topology); a ``.partial`` folder of ``tag`` left by a killed save is gone."""
    from deepspeed.checkpoint.constants import (
        PIPELINE_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    topology = Topology.from_engine(engine)
    saved = {**client_state.to_saved(), "topology": topology.to_record()}
    # AutoTP engines record their own; DeepSpeed 0.19.8's MoE save raises KeyError on the key in client_state (and
    # dstrain converts no MoE checkpoint: reshard.check_convertible); test_moe_router.py has the canary.
    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None and not engine.has_moe_layers:
        # What Megatron-DeepSpeed records for ds_to_universal. Our parameters need no TP/vocab patterns; a
        # pipeline's tied embedding module is kept on the first and the last stage, and only the first stage's
        # copy is whole (the last stage never updates gpt2's position table), so the converter must take that one.
        saved[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\."],
        }
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(checkpoint_dir / (tag + PARTIAL), ignore_errors=True)  # left by a save that was killed
    torch.distributed.barrier()
    return saved, topology


def publish(checkpoint_dir: Path, step: int, topology: Topology, keep_last: int, identity: Identity | None) -> None:
    """Rank 0, once every rank's files of ``step`` are in its ``.partial`` folder: record their sizes, rename the
    folder to its tag, point ``latest`` at it, and drop the oldest published tags beyond ``keep_last``."""
    if torch.distributed.get_rank() != 0:
        return
    tag = tag_for(step)
    folder = checkpoint_dir / (tag + PARTIAL)
    sums = set(folder.glob(integrity.SUMS.format("*")))
    names = [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file() and p not in sums]
    checksums = integrity.collect_sums(folder, names)
    files = {name: (folder / name).stat().st_size for name in names}
    seq = 1 + max((save_seq(checkpoint_dir / t) for t in published_tags(checkpoint_dir)), default=0)
    record = CheckpointRecord(step, seq, files, checksums, integrity.HASH, topology, identity)
    write_text_atomic(folder / RECORD, record.to_json())
    shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)  # a re-save of the same step after a resume
    os.replace(folder, checkpoint_dir / tag)
    write_text_atomic(checkpoint_dir / LATEST, tag)
    older = [t for t in published_tags(checkpoint_dir) if t != tag]
    for old in older[: max(0, len(older) - (max(1, keep_last) - 1))]:
        shutil.rmtree(checkpoint_dir / old, ignore_errors=True)


def load(engine, checkpoint_dir: Path, tag: str) -> ClientState:
    """Restore model, optimizer, scheduler and loss scale; return our client state.

    A tag saved under another topology loads from the conversion reshard.prepare_resume made in it."""
    load_dir, load_tag = reshard.load_source(engine, checkpoint_dir / tag)
    with safe_load.only_weights():
        path, client_state = engine.load_checkpoint(
            str(load_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint_dir / tag}")
    if engine.zero_nvme_offload_optimizer():
        nvme.restore_what_deepspeed_skips(engine, load_dir, load_tag)
    cpu_adam_steps.replay_bias_corrections(engine)  # a DeepSpeed defect: the module says which
    reshard.repair_after_load(engine, checkpoint_dir / tag)
    try:
        return ClientState.from_saved(client_state)
    except ValueError as e:
        raise DstrainError(f"{checkpoint_dir / tag}: {e}; resume it with the dstrain that saved it") from None
