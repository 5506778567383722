"""The record each published checkpoint tag carries (`dstrain_checkpoint.json`): its files and their sizes,
its save number, the topology it was saved under and the identity of its experiment."""

from __future__ import annotations

import json
from pathlib import Path

PARTIAL = ".partial"  # suffix of a tag folder while it is being written
RECORD = "dstrain_checkpoint.json"


def read_record(tag_dir: Path) -> dict | None:
    try:
        return json.loads((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
