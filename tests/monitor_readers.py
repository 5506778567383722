"""The monitors' files read back by their own clients: W&B's record format, TensorBoard's EventAccumulator,
csv.

wandb 0.31.0 ships no reader of its .wandb files (the Python ``wandb.sdk.internal.datastore`` went with the move to
wandb-core; ``wandb.beta.LocalApi`` is an open pull request, wandb/wandb#12745). The file is W&B's leveldb-style
log (the format that datastore.py documented: a 7-byte header, then 32 KiB blocks of records, each a CRC-32,
a length, a type FULL/FIRST/MIDDLE/LAST and its bytes); each record is W&B's own protobuf,
``wandb_internal_pb2.Record``, parsed by wandb's generated code. The framing is the dozen lines below.
"""

from __future__ import annotations

import csv
import json
import struct
import zlib
from collections import defaultdict
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # crc32 of type + data, length, type
FULL, LAST = 1, 4


def wandb_records(path: Path):
    """Every protobuf Record of one .wandb file, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B log"
    at, pending = 7, b""
    while at + HEADER.size <= len(data):
        if BLOCK - at % BLOCK < HEADER.size:  # a block's tail too short for a header is padding
            at += BLOCK - at % BLOCK
            continue
        crc, length, kind = HEADER.unpack_from(data, at)
        chunk = data[at + HEADER.size : at + HEADER.size + length]
        at += HEADER.size + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: damaged record at byte {at}"
        pending += chunk
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(wandb_dir: Path) -> list[dict]:
    """Each session's .wandb file under ``wandb_dir`` (W&B's wandb/ folder), in time order: its run id, its
    history rows ({key: value} with ``_step``), its alerts (title, text), its config and its exit code (None: the
    job did not finish it)."""
    sessions = []
    for path in sorted(wandb_dir.glob("*run-*/run-*.wandb")):
        session: dict = {"id": None, "history": [], "alerts": [], "config": {}, "exit_code": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["id"] = record.run.run_id
                session["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                session["history"].append(row)
            elif kind == "alert":
                session["alerts"].append((record.alert.title, record.alert.text))
            elif kind == "exit":
                session["exit_code"] = record.exit.exit_code
            elif kind == "config":
                session["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        sessions.append(session)
    return sessions


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def tensorboard_texts(folder: Path) -> dict[str, list[tuple[int, str]]]:
    """{tag: [(step, text)]} of add_text's summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    accumulator.Reload()
    texts = {}
    for tag in accumulator.Tags()["tensors"]:
        events = accumulator.Tensors(tag)
        texts[tag.removesuffix("/text_summary")] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events]
    return texts


def csv_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{file name without .csv: [(step, value)]} of the CSV monitor's files (events.csv apart)."""
    out = defaultdict(list)
    for path in sorted(folder.glob("*.csv")):
        if path.name == "events.csv":
            continue
        with path.open(newline="") as f:
            rows = list(csv.reader(f))[1:]
        out[path.stem] = [(int(step), float(value)) for step, value in rows]
    return dict(out)
