"""The objective seam (dstrain.objectives): the registry is the one switch. The loop, the launch's checks, the strategy
and the planner name no objective; a third objective registered by this test alone (no line of src/ changed) trains
through the loop with its own forward and component, is refused by its layout, and is counted by the estimate."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dstrain.objectives.objective import DATA_KINDS, LAYOUTS, Objective, PassBeforeTraining
from dstrain.objectives.registry import OBJECTIVES
from dstrain.train.objectives.training import ObjectiveTraining, training
from dstrain.train.step.components import Component
from dstrain.train.step.forward import ModelForward
from dstrain.train.step.steps import TrainStep

from ranks import run_ranks
from train_helpers import ROOT, read_metrics, small_recipe, train, train_argv

SRC = ROOT / "src" / "dstrain"
# What names no objective: the loop and the launch, the checks every recipe goes through, the strategy, the planner.
NEUTRAL = [
    "train/loop.py", "train/run.py", "train/preflight.py", "train/features/builders.py", "recipe_checks.py",
    "recipe_file.py", "strategy", "plan",
]  # fmt: skip


def named_in_code(path: Path) -> set[str]:
    """Every identifier, attribute, imported module and string of ``path``'s code (docstrings and comments aside)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module or "", *(alias.name for alias in node.names)])
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


@pytest.mark.unit
@pytest.mark.parametrize("where", NEUTRAL)
def test_the_loop_checks_strategy_and_planner_name_no_objective(where):
    paths = [SRC / where] if where.endswith(".py") else sorted((SRC / where).rglob("*.py"))
    objectives = [name for name in OBJECTIVES if name != "language_model"] + ["language_model", "simpo", "pairs"]
    found = sorted(
        f"{path.relative_to(SRC)}: {name}"
        for path in paths
        for name in named_in_code(path)
        if any(objective in name.lower() for objective in objectives)
    )
    assert found == []


@pytest.mark.unit
def test_the_walker_sees_a_switch_on_an_objective(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text('"""Docs may name preference."""\nif recipe.preference is not None:\n    x = "simpo"\n')
    assert {"preference", "simpo"} <= named_in_code(path) and "Docs may name preference." not in named_in_code(path)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_objective_is_one_record_on_each_side_of_torch(name):
    objective = OBJECTIVES[name]
    assert objective.name == name and objective.training == f"dstrain.train.objectives.{name}"
    assert isinstance(training(objective), ObjectiveTraining)
    assert set(objective.refuses) <= set(LAYOUTS) and objective.data_kinds <= set(DATA_KINDS)
    if objective.section is not None:  # its section is the recipe's field of that name
        from dstrain.config import Recipe

        assert objective.section in {f.name for f in dataclasses.fields(Recipe)}


@pytest.mark.unit
def test_every_kind_of_data_has_an_objective_and_one_objective_is_the_default():
    assert {kind for o in OBJECTIVES.values() for kind in o.data_kinds} == set(DATA_KINDS)
    assert [o.name for o in OBJECTIVES.values() if o.section is None] == ["language_model"]


# --- a third objective, registered by this test alone ----------------------------------------------------------------
class DoubledForward(ModelForward):
    """The language-model loss, doubled: its step-1 loss and gradient are the LM's exactly x 2."""

    def _forward_loss(self, batch: dict):
        return 2 * super()._forward_loss(batch)


class StepCounter(Component):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, outcome):
        self.steps += 1
        return super().on_step_end(outcome)

    def train_record_fields(self, progress, steps: int) -> dict:
        return {"toy_steps": self.steps}


class ToyObjective(Objective):
    def chosen(self, recipe) -> bool:  # a section of its own would be a field of Recipe; the test has none
        return recipe.name == "toy"


TOY = ToyObjective(
    name="toy",
    training=__name__,
    section=None,
    data_kinds=frozenset({"text"}),
    chosen_by="the toy objective (name: toy)",
    refuses={"pipeline": "does not run the toy objective; use a ZeRO ds_config"},
    memory=lambda recipe: PassBeforeTraining("toy pass", "12345", lambda recipe, micro, sp, act: 12345 * micro),
)
TRAINING = ObjectiveTraining(forward=DoubledForward, step=TrainStep, components=(lambda run: StepCounter(),))


def train_each_with_toy(argvs: list[list[str]]) -> list[int]:
    """Rank target: the toy registered in this rank's registry, then dstrain.train once per argv."""
    OBJECTIVES["toy"] = TOY
    return [train(argv) for argv in argvs]


@pytest.mark.distributed
def test_a_third_objective_trains_through_the_loop_with_its_forward_and_component(tmp_path, corpus):
    lm = small_recipe(tmp_path, corpus, name="lm", train={"steps": 2, "eval_interval": 0})
    toy = small_recipe(tmp_path, corpus, name="toy", train={"steps": 2, "eval_interval": 0})
    argvs = [train_argv(recipe, "zero1", tmp_path / recipe.stem) for recipe in (lm, toy)]
    assert run_ranks(1, train_each_with_toy, argvs) == [[0, 0]]
    (lm_first, *_), (toy_first, *rest) = [
        [r for r in read_metrics(tmp_path / n) if "split" not in r] for n in "lm toy".split()
    ]
    assert toy_first["loss"] == pytest.approx(2 * lm_first["loss"], rel=1e-6)  # fp32, same init, same batch
    assert toy_first["grad_norm"] == pytest.approx(2 * lm_first["grad_norm"], rel=1e-5)  # pre-clip
    assert [toy_first["toy_steps"], *(r["toy_steps"] for r in rest)] == [1, 2] and "toy_steps" not in lm_first


@pytest.mark.unit
def test_a_third_objective_is_refused_by_its_layout_and_counted_by_the_estimate(tmp_path, corpus, monkeypatch):
    from dstrain.errors import DstrainError
    from dstrain.plan.memory import estimate
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    monkeypatch.setitem(OBJECTIVES, "toy", TOY)
    recipe = load_recipe(small_recipe(tmp_path, corpus, name="toy"))
    pipeline = ROOT / "ds_configs" / "pp2_zero1.json"
    with pytest.raises(DstrainError, match=r"pp2_zero1.json: pipeline parallelism does not run the toy objective"):
        resolve(recipe, "toy.yaml", load_ds_config(str(pipeline)), str(pipeline), 2)
    zero1 = ROOT / "ds_configs" / "zero1.json"
    est = estimate(recipe, resolve(recipe, "toy.yaml", load_ds_config(str(zero1)), str(zero1), 2), 1, 2)
    (part,) = [p for p in est.parts if p.name == "toy pass"]
    assert est.reference_pass and part.reference == 12345 * est.micro_batch and "reference" in est.phases
    monkeypatch.delitem(OBJECTIVES, "toy")
    assert not estimate(recipe, resolve(recipe, "lm.yaml", load_ds_config(str(zero1)), str(zero1), 2), 1, 2).phases[2:]


@pytest.mark.unit
def test_a_recipe_choosing_two_objectives_is_refused_naming_both_sections(tmp_path, corpus, monkeypatch):
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe

    second = Objective("second", __name__, "init_from", frozenset({"text"}), "init_from (a test's objective)")
    monkeypatch.setitem(OBJECTIVES, "second", second)
    path = small_recipe(tmp_path, corpus, preference={"loss": "simpo"}, init_from=str(tmp_path))
    with pytest.raises(DstrainError, match=rf"^{path}: preference: and init_from: each choose a training objective"):
        load_recipe(path)
    monkeypatch.delitem(OBJECTIVES, "second")
    assert load_recipe(path).preference is not None
