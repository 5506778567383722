"""The trainer's client state (dstrain.checkpoint.record.ClientState): one schema, written and read in one place."""

from dstrain.checkpoint.record import ClientState

STATE = ClientState(
    consumed_samples=80,
    rng={"python": [3], "numpy": [4], "torch": [5]},
    recipe={"name": "small"},
    data_fingerprint="abc",
    world_size=2,
    strategy="zero1",
)


def test_a_saved_client_state_reads_back_as_it_was_among_deepspeeds_keys():
    saved = {**STATE.to_saved(), "topology": {"zero_stage": 1}, "universal_checkpoint_info": {}}  # store adds these
    assert ClientState.from_saved(saved) == STATE
    guarded = ClientState(**{**STATE.__dict__, "spike_guard": {"history": [1.0], "lr": 4}})
    assert ClientState.from_saved(guarded.to_saved()) == guarded


def test_a_run_without_a_spike_guard_saves_no_guard_key():
    assert set(STATE.to_saved()) == {"consumed_samples", "rng", "recipe", "data_fingerprint", "world_size", "strategy"}
    assert ClientState.from_saved(STATE.to_saved()).spike_guard is None
