"""init_from as one typed value resolved once at launch (dstrain.checkpoint.model_source): a run, a Hugging Face folder
or nothing; the recipe loads without reading model files, and a launch asks once whether init_from is a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dstrain.checkpoint.model_source import HFFolderSource, RunSource, load_recipe_and_source, model_source
from dstrain.errors import DstrainError
from dstrain.recipe_file import load_recipe
from dstrain.run_dir import RunDir

from ranks import run_ranks
from train_helpers import read_metrics, small_recipe, train, train_argv


@pytest.mark.unit
def test_a_recipe_loads_without_reading_init_froms_files(tmp_path, corpus):
    """load_recipe takes init_from as written, whatever its folder holds (here a config.json that is no model); the
    launch's reading resolves it and fills the model from it, refusing a config.json that is no model by the key."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("not json")
    path = small_recipe(tmp_path, corpus, init_from=str(folder))
    assert load_recipe(path).init_from == str(folder)
    with pytest.raises(DstrainError, match=rf"^{path}: init_from: {folder}/config.json: not a Hugging Face model"):
        load_recipe_and_source(path)
    (folder / "config.json").unlink()  # a shipped recipe on a machine without the weights: its model written out
    recipe, source = load_recipe_and_source(path)
    assert source == HFFolderSource(str(folder), folder) and recipe.model == load_recipe(path).model
    without_model = yaml.safe_load(path.read_text())
    del without_model["model"]
    path.write_text(yaml.safe_dump(without_model))
    with pytest.raises(DstrainError, match=rf"^{path}: init_from: {folder}/config.json: no such file"):
        load_recipe_and_source(path)


@pytest.mark.unit
def test_init_from_resolves_to_a_run_a_folder_or_nothing(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: x\n")
    assert model_source(run) == RunSource(str(run), RunDir(run))
    assert model_source(tmp_path / "hf") == HFFolderSource(str(tmp_path / "hf"), tmp_path / "hf")
    assert load_recipe_and_source(small_recipe(tmp_path, corpus))[1] is None


def train_counting_asks(argv: list[str], init_from: str) -> dict:
    """Rank target: dstrain.train, counting the times this rank asks whether ``init_from`` is a run (RunDir.find on
    it) and looks for its config.json."""
    from unittest import mock

    target = Path(init_from).resolve()
    asks = {"run?": 0, "config.json?": 0}
    find, is_file = RunDir.find.__func__, Path.is_file

    def counting_find(cls, path):
        asks["run?"] += Path(path).resolve() == target
        return find(cls, path)

    def counting_is_file(self):
        asks["config.json?"] += self.name == "config.json" and self.parent.resolve() == target
        return is_file(self)

    with (
        mock.patch.object(RunDir, "find", classmethod(counting_find)),
        mock.patch.object(Path, "is_file", counting_is_file),
    ):
        assert train(argv) == 0
    return asks


@pytest.mark.distributed
def test_a_launch_asks_once_whether_init_from_is_a_run(tmp_path, corpus):
    """An SFT-like continuation of a run: one rank asks once, and never looks for a config.json in it."""
    first = tmp_path / "first"
    recipe = small_recipe(tmp_path, corpus, train={"steps": 1}, schedule={"warmup_steps": 0})
    assert run_ranks(1, train, train_argv(recipe, "zero1", first)) == [0]
    second = small_recipe(
        tmp_path, corpus, name="second", init_from=str(first), train={"steps": 1}, schedule={"warmup_steps": 0}
    )
    argv = train_argv(second, "zero1", tmp_path / "second")
    assert run_ranks(1, train_counting_asks, argv, str(first)) == [{"run?": 1, "config.json?": 0}]
    assert read_metrics(tmp_path / "second")[0]["step"] == 1


@pytest.mark.unit
def test_the_recipe_layer_imports_no_model_file_reader():
    """recipe_file, config and recipe_checks (the recipe layer) import neither the Hugging Face conversion nor the
    checkpoint readers, anywhere in their code: reading init_from is the launch's (dstrain.checkpoint.model_source)."""
    from test_imports import graph

    edges = graph()
    found = {
        f"{name} imports {target}"
        for name in ("dstrain.recipe_file", "dstrain.config", "dstrain.recipe_checks")
        for target in edges[name]
        if target.startswith(("dstrain.model.hf", "dstrain.checkpoint"))
    }
    assert found == set()
