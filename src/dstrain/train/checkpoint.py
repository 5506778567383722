"""Checkpoints in DeepSpeed's layout, published atomically.

DeepSpeed writes each tag folder in place and then its `latest` file, so a job killed
mid-save can leave a partial folder behind. We save under `<tag>.partial`, record every
file's size in `dstrain_checkpoint.json`, rename the folder to `<tag>` and only then
replace `latest`: a published tag is always complete, and at resume a tag whose files no
longer match its record (truncated, deleted) is skipped with a warning.

The record also numbers the saves of a run folder (``save_seq``): keep-last prunes and a resume
without a usable ``latest`` picks in that order, so a tag left by a longer branch never outranks the
checkpoint just written.

Each checkpoint also records the topology it was saved under (ZeRO stage, world, data-parallel,
tensor-parallel and pipeline sizes, precision) and DeepSpeed's universal-checkpoint info, so that a run
can resume under another one (dstrain.train.topology).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from dstrain.strategy import Topology
from dstrain.train import topology

PARTIAL = ".partial"
RECORD = "dstrain_checkpoint.json"
TAG = re.compile(r"^global_step(\d+)$")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def published_tags(checkpoint_dir: Path) -> list[str]:
    """Published tags, oldest save first (tags without a save number, from before it was recorded, by step)."""
    if not checkpoint_dir.is_dir():
        return []
    tags = [p.name for p in checkpoint_dir.iterdir() if p.is_dir() and TAG.match(p.name)]
    return sorted(tags, key=lambda t: (save_seq(checkpoint_dir / t), int(TAG.match(t).group(1))))


def read_record(tag_dir: Path) -> dict | None:
    try:
        return json.loads((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


def save_seq(tag_dir: Path) -> int:
    record = read_record(tag_dir)
    return int(record.get("save_seq", -1)) if isinstance(record, dict) else -1


def is_complete(tag_dir: Path) -> bool:
    try:
        record = json.loads((tag_dir / RECORD).read_text())
        return all((tag_dir / name).stat().st_size == size for name, size in record["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def newest_complete(checkpoint_dir: Path) -> str | None:
    """The tag ``latest`` names when it is complete, else the most recently saved complete one; broken ones are
    reported and passed over."""
    try:
        latest = (checkpoint_dir / "latest").read_text().strip()
    except OSError:
        latest = None
    if latest and TAG.match(latest) and is_complete(checkpoint_dir / latest):
        return latest
    for tag in reversed(published_tags(checkpoint_dir)):
        if is_complete(checkpoint_dir / tag):
            return tag
        warnings.warn(f"checkpoint {checkpoint_dir / tag} is incomplete or corrupt; skipping it", stacklevel=2)
    return None


def save(engine, checkpoint_dir: Path, step: int, client_state: dict, keep_last: int, identity: dict | None = None) -> str:
    """Save on every rank, publish on rank 0, then drop the oldest saves beyond ``keep_last``, never this one.

    ``identity`` (what makes the checkpoint meaningless for another experiment) goes into the record, where a
    resume compares it with its recipe before writing anything."""
    from deepspeed.checkpoint.constants import (
        PIPELINE_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    tag = tag_for(step)
    partial = tag + PARTIAL
    is_writer = torch.distributed.get_rank() == 0
    shape = Topology.from_engine(engine).to_record()
    client_state = {**client_state, "topology": shape}
    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None:  # AutoTP engines record their own
        # What Megatron-DeepSpeed records for ds_to_universal. Our parameters need no TP/vocab patterns; a
        # pipeline's tied embedding module is kept on the first and the last stage, and only the first stage's
        # copy is whole (the last stage never updates gpt2's position table), so the converter must take that one.
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                                                   PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\."]}
    if is_writer:
        shutil.rmtree(checkpoint_dir / partial, ignore_errors=True)  # left by a save that was killed
    torch.distributed.barrier()
    engine.save_checkpoint(str(checkpoint_dir), tag=partial, client_state=client_state, save_latest=False)
    torch.distributed.barrier()  # every rank's shards are on disk
    if is_writer:
        folder = checkpoint_dir / partial
        files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
        seq = 1 + max((save_seq(checkpoint_dir / t) for t in published_tags(checkpoint_dir)), default=0)
        record = {"step": step, "save_seq": seq, "files": files, "topology": shape, "identity": identity}
        _write_atomic(folder / RECORD, json.dumps(record, indent=1))
        shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)  # a re-save of the same step after a resume
        os.replace(folder, checkpoint_dir / tag)
        _write_atomic(checkpoint_dir / "latest", tag)
        older = [t for t in published_tags(checkpoint_dir) if t != tag]
        for old in older[:max(0, len(older) - (max(1, keep_last) - 1))]:
            shutil.rmtree(checkpoint_dir / old, ignore_errors=True)
    torch.distributed.barrier()
    return tag


def load(engine, checkpoint_dir: Path, tag: str) -> dict:
    """Restore model, optimizer, scheduler and loss scale; return our client state.

    A tag saved under another topology loads from the conversion topology.prepare_resume made in it."""
    load_dir, load_tag = topology.load_source(engine, checkpoint_dir / tag)
    path, client_state = engine.load_checkpoint(
        str(load_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint_dir / tag}")
    topology.repair_after_load(engine, checkpoint_dir / tag)
    return client_state


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
