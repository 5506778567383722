"""The record each published checkpoint tag carries (`dstrain_checkpoint.json`), as one typed dataclass: its files
with their sizes and checksums, its save number, the topology it was saved under and the identity of its experiment;
and the trainer's client state inside DeepSpeed's files (``ClientState``), the one schema it is written and read by."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

PARTIAL = ".partial"  # suffix of a tag folder while it is being written
RECORD = "dstrain_checkpoint.json"


@dataclass(frozen=True)
class CheckpointRecord:
    step: int  # optimizer steps done when the tag was saved
    save_seq: int  # the save's number in its run folder: keep-last and a resume without `latest` go by it
    files: dict[str, int]  # every file of the tag (path relative to the tag folder) -> its size in bytes
    checksums: dict[str, str] = field(default_factory=dict)  # path -> hex digest; {} in tags saved before them
    hash: str | None = None  # the checksums' algorithm (dstrain.checkpoint.integrity.HASH)
    topology: dict | None = None  # strategy.topology.Topology.to_record() of the run that saved it
    identity: dict | None = None  # what makes it meaningless for another experiment (dstrain.train.run.identity)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointRecord:
        """A ValueError for a record that is not one (a missing field, a wrong type)."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
            raise ValueError("not a checkpoint record")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            record = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as e:
            raise ValueError(str(e)) from None
        if not isinstance(record.save_seq, int) or not isinstance(record.checksums, dict):
            raise ValueError("not a checkpoint record")
        return record


def read_record(tag_dir: Path) -> CheckpointRecord | None:
    try:
        return CheckpointRecord.from_json((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ClientState:
    """What the trainer saves beside the engine's state, in DeepSpeed's ``client_state`` of every checkpoint
    (dstrain.checkpoint.store adds the topology and DeepSpeed's universal-checkpoint info on its way to disk)."""

    consumed_samples: int  # samples of the train stream consumed (dstrain.train.loop.Progress)
    rng: dict  # store.rng_state(): python, numpy and torch generators
    recipe: dict  # config.to_dict of the recipe it was trained under: a resume names what changed since
    data_fingerprint: str | None  # the prepared data's; a resume on other data is refused
    world_size: int
    strategy: str  # the ds_config's name
    spike_guard: dict | None = None  # train.spike_guard.SpikeGuard.state_dict(), in runs with train.spike_guard

    def to_saved(self) -> dict:
        """The keys DeepSpeed saves: these fields, a guard's only when there is one."""
        saved = dataclasses.asdict(self)
        if self.spike_guard is None:
            del saved["spike_guard"]
        return saved

    @classmethod
    def from_saved(cls, saved: dict) -> ClientState:
        """From what engine.load_checkpoint returns (DeepSpeed's client state holds other keys too)."""
        return cls(
            consumed_samples=saved["consumed_samples"],
            rng=saved["rng"],
            recipe=saved.get("recipe") or {},
            data_fingerprint=saved.get("data_fingerprint"),
            world_size=saved.get("world_size", 0),
            strategy=saved.get("strategy", ""),
            spike_guard=saved.get("spike_guard"),
        )
