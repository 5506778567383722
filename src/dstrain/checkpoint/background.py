"""Checkpoints that do not stop training: a host-memory snapshot now, the write in the background.

Plugged in through DeepSpeed's checkpoint-engine interface (deepspeed/runtime/checkpoint_engine/): for the length of
``engine.save_checkpoint`` the engine's checkpoint engine is a ``SnapshotEngine``, whose ``save`` copies the state
dict's tensors into host buffers (kept from one save to the next) and queues it instead of writing it.
Training resumes as soon as the copy is made; a thread then ``torch.save``s the queue into ``<tag>.partial``,
hashing each file as it goes (dstrain.checkpoint.integrity.ChecksummedEngine).
DeepSpeed's own background writers (FastCheckpointEngine, DecoupledCheckpointEngine) are not used: a probe reported
in issue 17 found them failing or hanging on CPU (not re-checked here), and they know nothing of our ``.partial`` ->
record -> rename -> ``latest`` publication, which must wait for every rank's files.

Every guarantee of a synchronous save holds (dstrain.checkpoint.store):
- publication waits for every rank's writer: each step's one all-reduce carries "my write is done", and rank 0
  publishes (record, rename, ``latest``, keep-last) in the step where all ranks report it, so a death mid-write
  leaves ``latest`` on the previous complete tag and a resume there equals the uninterrupted run;
- at most one write is in flight: the next save, a rollback, the final or the interrupt checkpoint first wait for it;
- keep-last only ever deletes published tags, and the tag being written is still ``<tag>.partial``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from dstrain.checkpoint import store
from dstrain.checkpoint.integrity import ChecksummedEngine
from dstrain.checkpoint.record import PARTIAL, ClientState, Identity
from dstrain.run_dir import tag_for
from dstrain.strategy.topology import Topology

HOST = torch.device("cpu")  # host memory, whatever the accelerator: where a snapshot waits for the disk


class SnapshotEngine(ChecksummedEngine):
    """DeepSpeed checkpoint engine whose ``save`` snapshots the state to host memory and queues the write.

    The host buffers of one save are kept for the next (``buffers``: file name -> its tensors in traversal order):
    allocating and first touching a checkpoint's worth of fresh memory each time cost more than the copy itself
    (gpt2-125m on CPU), and on GPUs they are pinned once. The cost: one checkpoint's worth of host memory per rank."""

    def __init__(self, config_params=None, buffers: dict | None = None):
        super().__init__(config_params)
        self.queue: list[tuple[dict, str]] = []
        self.buffers: dict[str, list[torch.Tensor]] = buffers if buffers is not None else {}

    def save(self, state_dict, path: str) -> None:
        name = Path(path).name
        old, new = iter(self.buffers.get(name, [])), []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            buffer = next(old, None)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST)
                if tensor.device != buffer.device:
                    buffer = get_accelerator().pin_memory(buffer)
            buffer.copy_(tensor.detach(), non_blocking=True)
            new.append(buffer)
            return buffer

        self.queue.append((_map_tensors(state_dict, copy), path))
        self.buffers[name] = new
        get_accelerator().synchronize()  # the device-to-host copies are done before training changes the state

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed would clone first; our snapshot is that copy already

    def write_all(self) -> None:
        for state, path in self.queue:
            self.write(state, path)  # hashed; a full disk is recorded, not raised
        self.queue = []


def _map_tensors(item, fn):
    """``item`` with every tensor in its dicts, lists and tuples replaced by ``fn(tensor)`` (as DeepSpeed's
    clone_tensors_for_torch_save walks it)."""
    if torch.is_tensor(item):
        return fn(item)
    if isinstance(item, list):
        return [_map_tensors(v, fn) for v in item]
    if isinstance(item, tuple):
        return tuple(_map_tensors(v, fn) for v in item)
    if isinstance(item, dict):
        return type(item)({k: _map_tensors(v, fn) for k, v in item.items()})
    return item


class BackgroundSaves:
    """The one checkpoint of a run that may be in flight, and its publication."""

    def __init__(self, engine, checkpoint_dir: Path, keep_last: int, identity: Identity | None):
        self.engine, self.checkpoint_dir, self.keep_last, self.identity = engine, checkpoint_dir, keep_last, identity
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.step = 0
        self.topology: Topology | None = None  # of the write in flight
        self.snapshot: SnapshotEngine | None = None
        self.write_s = 0.0  # how long the last background write took
        self.buffers: dict[str, list[torch.Tensor]] = {}  # SnapshotEngine's host buffers, reused by every save

    @property
    def in_flight(self) -> bool:
        return self.thread is not None

    def start(self, step: int, client_state: ClientState, rank_files: dict | None = None) -> None:
        """Every rank: snapshot the state of ``step`` (and ``rank_files``, as store.save) and start writing it; waits
        for an earlier write first."""
        self.wait()
        saved, topology = store.prepare(self.engine, self.checkpoint_dir, tag_for(step), client_state)
        snapshot = SnapshotEngine(self.engine._config, self.buffers)
        store.write_partial(self.engine, self.checkpoint_dir, tag_for(step), saved, snapshot, rank_files)
        self.step, self.topology, self.error, self.snapshot = step, topology, None, snapshot
        self.thread = threading.Thread(target=self._write, args=(snapshot,), name="dstrain-checkpoint", daemon=True)
        self.thread.start()

    def _write(self, snapshot: SnapshotEngine) -> None:
        start = time.perf_counter()
        try:
            snapshot.write_all()
            snapshot.write_sums(self.checkpoint_dir / (tag_for(self.step) + PARTIAL), torch.distributed.get_rank())
        except BaseException as e:  # re-raised in the training thread by done()
            self.error = e
        self.write_s = time.perf_counter() - start

    def done(self) -> bool:
        """This rank's write is over (or none is in flight); its failure is raised here, in the training thread."""
        if self.error is not None:
            raise self.error
        return self.thread is None or not self.thread.is_alive()

    def publish(self) -> str:
        """Every rank, once all ranks' writes are done (agreed in one collective): rank 0 publishes the tag, unless
        a rank's disk filled (then DiskFull on every rank, the partial tag removed)."""
        disk_full = self.snapshot.disk_full if self.snapshot else None
        self.thread, self.snapshot = None, None
        store.agree_written(self.engine, self.checkpoint_dir, tag_for(self.step), disk_full)
        assert self.topology is not None
        store.publish(self.checkpoint_dir, self.step, self.topology, self.keep_last, self.identity)
        return tag_for(self.step)

    def wait(self) -> str | None:
        """Every rank: wait for the write in flight, then publish it; its tag (None: none was in flight)."""
        if self.thread is None:
            return None
        self.thread.join()
        self.done()
        torch.distributed.barrier()
        tag = self.publish()
        torch.distributed.barrier()
        return tag
