"""The typed checkpoint data (dstrain.checkpoint.record): the trainer's ClientState and the tag's CheckpointRecord
with its Topology and Identity, each written and read by one schema, dataclasses on both sides of the bytes."""

import dataclasses
import json

import pytest

from dstrain.checkpoint.record import RECORD, SCHEMA, CheckpointRecord, ClientState, Identity, read_record
from dstrain.strategy.topology import Topology

STATE = ClientState(
    consumed_samples=80,
    rng={"python": [3], "numpy": [4], "torch": [5]},
    recipe={"name": "small"},
    data_fingerprint="abc",
    world_size=2,
    strategy="zero1",
)
TOPOLOGY = Topology(world_size=4, zero_stage=3, dp_size=2, tp_size=1, pp_stages=2, precision="bf16", sp_size=1)
IDENTITY = Identity(model={"n_layer": 2, "moe": None}, seq_len=32, valid_fraction=0.1, data="f00d", seed=1,
                    optimizer="adamw")  # fmt: skip


def test_a_saved_client_state_reads_back_as_it_was_among_deepspeeds_keys():
    saved = {**STATE.to_saved(), "topology": {"zero_stage": 1}, "universal_checkpoint_info": {}}  # store adds these
    assert ClientState.from_saved(saved) == STATE
    guarded = dataclasses.replace(STATE, components={"spike_guard": {"history": [1.0], "lr": 4}})
    assert ClientState.from_saved(guarded.to_saved()) == guarded
    assert guarded.to_saved()["schema"] == SCHEMA


def test_a_client_state_of_another_schema_is_refused():
    with pytest.raises(ValueError, match="schema"):
        ClientState.from_saved({**STATE.to_saved(), "schema": SCHEMA + 1})
    unversioned = STATE.to_saved()
    del unversioned["schema"]
    with pytest.raises(ValueError, match="schema"):
        ClientState.from_saved(unversioned)


def test_a_record_round_trips_as_dataclasses(tmp_path):
    record = CheckpointRecord(7, 3, {"a.pt": 10}, {"a.pt": "ff"}, "blake2b", TOPOLOGY, IDENTITY)
    (tmp_path / RECORD).write_text(record.to_json())
    back = read_record(tmp_path)
    assert back == record
    assert isinstance(back.topology, Topology) and isinstance(back.identity, Identity)
    assert json.loads(record.to_json())["schema"] == SCHEMA
    anonymous = dataclasses.replace(record, identity=None)  # a caller that records no identity
    assert CheckpointRecord.from_json(anonymous.to_json()) == anonymous


def test_a_record_of_another_schema_or_shape_is_unreadable(tmp_path):
    raw = json.loads(CheckpointRecord(1, 1, {}, {}, "blake2b", TOPOLOGY, IDENTITY).to_json())
    for broken in ({**raw, "schema": SCHEMA + 1}, {k: v for k, v in raw.items() if k != "topology"},
                   {**raw, "topology": {**raw["topology"], "stages": 2}}):  # fmt: skip
        (tmp_path / RECORD).write_text(json.dumps(broken))
        assert read_record(tmp_path) is None


def test_identity_names_the_fields_that_differ():
    other = dataclasses.replace(IDENTITY, seed=2, optimizer="muon")
    assert IDENTITY.differences(other) == ["seed", "optimizer"]
    assert IDENTITY.differences(IDENTITY) == []
