"""The trainer's components (dstrain.train.step.components): the loop's one protocol, called in the assembled order."""

from pathlib import Path
from types import SimpleNamespace

import torch

from dstrain.train.step.components import Component, Components, Progress, StepOutcome, Verdict

OUTCOME = StepOutcome(step=3, loss=2.5, grad_norm=1.0, stop_requested=False)


class Recorder(Component):
    def __init__(self, name: str, calls: list, verdict: Verdict = Verdict.GO_ON, state: dict | None = None) -> None:
        self.name, self.calls, self.verdict, self.state = name, calls, verdict, state
        self.state_key = name if state is not None else None

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        self.calls.append(self.name)
        return self.verdict

    def on_eval_end(self, records: list[dict]) -> Verdict:
        self.calls.append((self.name, len(records)))
        return self.verdict

    def on_checkpoint_published(self, tag: str) -> None:
        self.calls.append((self.name, tag))

    def lr_scale(self, step: int) -> float:
        return 0.5

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        return loss + 1

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return {f"{self.name}_steps": steps}

    def state_dict(self) -> dict | None:
        return self.state

    def load_state_dict(self, state: dict | None) -> None:
        self.calls.append((self.name, state))

    def rank_files(self) -> dict:
        return {f"{self.name}.pt": {}}


def test_a_plain_component_is_off():
    off = Component()
    assert off.lr_scale(1) == 1.0 and off.on_step_end(OUTCOME) is Verdict.GO_ON
    assert off.on_eval_end([{}]) is Verdict.GO_ON and off.on_checkpoint_published("global_step2") is None
    loss = torch.tensor(2.0)
    assert off.objective(loss) is loss
    assert off.train_record_fields(Progress(), 1) == {} and off.valid_record_fields() == {}
    assert off.eval_records(lambda: []) == [] and off.state_dict() is None and off.rank_files() == {}
    off.load_files(Path("nowhere"))  # reads nothing


def test_components_are_called_in_order_and_an_undone_step_stops_the_rest():
    calls: list = []
    group = Components([Recorder("a", calls), Recorder("b", calls, Verdict.UNDONE), Recorder("c", calls)])
    assert group.on_step_end(OUTCOME) is Verdict.UNDONE
    assert calls == ["a", "b"]  # c never sees a step that b rolled back
    assert group.lr_scale(1) == 0.125
    assert group.objective(torch.tensor(1.0)).item() == 4.0
    assert list(group.train_record_fields(Progress(), 5)) == ["a_steps", "b_steps", "c_steps"]
    assert set(group.rank_files()) == {"a.pt", "b.pt", "c.pt"}


def test_only_components_with_state_travel_in_the_client_state():
    calls: list = []
    group = Components([Recorder("guard", calls, state={"lr": 4}), Recorder("meter", calls), Component()])
    assert group.state_dict() == {"guard": {"lr": 4}}
    group.load_state_dict({})  # a checkpoint of a run where the guard was off
    assert calls == [("guard", None)]


def test_a_stop_ends_the_step_and_every_component_sees_each_evaluation_and_checkpoint():
    calls: list = []
    group = Components([Recorder("a", calls), Recorder("b", calls, Verdict.STOP), Recorder("c", calls)])
    assert group.on_step_end(OUTCOME) is Verdict.STOP and calls == ["a", "b"]
    calls.clear()
    assert group.on_eval_end([{}, {}]) is Verdict.STOP  # one component's stop is the run's
    group.on_checkpoint_published("global_step4")
    assert calls == [("a", 2), ("b", 2), ("c", 2), ("a", "global_step4"), ("b", "global_step4"), ("c", "global_step4")]
    assert Components([Recorder("a", calls)]).on_eval_end([]) is Verdict.GO_ON


def test_a_feature_is_off_by_its_builder_returning_none():
    from dstrain.train.features import builders as features

    recipe = SimpleNamespace(train=SimpleNamespace(early_stop=SimpleNamespace(patience=0), export_every=0))
    run = SimpleNamespace(recipe=recipe)
    from dstrain.train.features import early_stop, hf_export

    assert early_stop.build(run) is None and hf_export.build(run) is None
    assert early_stop.build in features.BUILDERS and hf_export.build in features.BUILDERS
