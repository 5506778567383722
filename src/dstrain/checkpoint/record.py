"""The record each published checkpoint tag carries (`dstrain_checkpoint.json`), as one typed dataclass: its files
with their sizes and checksums, its save number, the topology it was saved under and the identity of its experiment."""

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
    topology: dict | None = None  # strategy.resolve.Topology.to_record() of the run that saved it
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
