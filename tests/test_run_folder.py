"""A run folder stands on its own: copied elsewhere, its data moved away, used from a third directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_fixtures import copy_prepared
from ranks import run_ranks
from train_helpers import small_recipe, train_argv

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "seed": 0}
EVAL_FLAGS = ["--samples", "16"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def use_run(run: Path, out: Path, data: Path | None) -> dict:
    """Export, greedy generation and eval (with --data when given) of ``run``, from the working directory."""
    import argparse

    from dstrain.commands import cli, evaluate, generate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    eval_args = parser.parse_args([str(run), *EVAL_FLAGS, *(["--data", str(data)] if data else [])])
    return {
        "export": cli.main(["export", str(run), "--out", str(out)]),
        "text": generate.generate(str(run), "The os module", **GREEDY),
        "eval": evaluate.evaluate(eval_args),
    }


def eval_error(run: Path) -> str:
    """The one-line error of `dstrain eval RUN` (its own data) where that data is gone."""
    import argparse

    from dstrain.commands import evaluate
    from dstrain.errors import DstrainError

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    try:
        evaluate.evaluate(parser.parse_args([str(run), *EVAL_FLAGS]))
    except DstrainError as e:
        return str(e)
    raise AssertionError("eval of a run whose data is gone did not fail")


def train_then_move(tmp: Path, argv: list[str]) -> dict:
    """Rank target (one rank): train in tmp/launch with relative paths, use the run there, then copy it to
    tmp/elsewhere, move the data to tmp/moved, and use the copy from tmp/third."""
    from dstrain.train.run import main

    launch, third = tmp / "launch", tmp / "third"
    os.chdir(launch)
    assert main(argv) == 0
    results = {"in_place": use_run(Path("runs/rf"), launch / "hf-in", Path("data/corp"))}
    os.chdir(third)  # the run's own data, found where its launch found it, from another directory
    results["own_data_from_third"] = use_run(launch / "runs" / "rf", third / "hf-own", None)["eval"]
    shutil.copytree(launch / "runs" / "rf", tmp / "elsewhere" / "rf")
    os.replace(launch / "data", tmp / "moved")
    results["copy"] = use_run(tmp / "elsewhere" / "rf", third / "hf-out", tmp / "moved" / "corp")
    results["gone"] = eval_error(tmp / "elsewhere" / "rf")
    return results


@pytest.fixture(scope="module")
def moved(tmp_path_factory, corpus):
    """(tmp, results of train_then_move, dstrain.train's argv) of a 3-step run under zero0."""
    tmp = tmp_path_factory.mktemp("run-folder")
    for name in ("launch/data", "third"):
        (tmp / name).mkdir(parents=True)
    copy_prepared(corpus, tmp / "launch" / "data" / "corp")
    recipe = small_recipe(tmp / "launch", Path("data/corp"), "rf", train={"steps": 3})
    argv = train_argv(Path("rf.yaml"), "zero0", Path("runs/rf"))
    (results,) = run_ranks(1, train_then_move, tmp, argv)
    assert recipe.is_file()
    return tmp, results, argv


@pytest.mark.distributed
def test_run_folder_carries_its_tokenizer_and_launch(moved):
    tmp, _, _ = moved
    run = tmp / "elsewhere" / "rf"
    prepared = tmp / "moved" / "corp" / "tokenizer"
    for name in TOKENIZER_FILES:  # copied byte for byte
        assert (run / "tokenizer" / name).read_bytes() == (prepared / name).read_bytes()
    import yaml

    recorded = yaml.safe_load((run / "recipe.yaml").read_text())
    assert recorded["data"]["sources"][0]["path"] == "data/corp"  # as written
    assert recorded["launch"] == {
        "cwd": str((tmp / "launch").resolve()),
        "paths": {"data.sources[0].path": str((tmp / "launch" / "data" / "corp").resolve())},
    }


@pytest.mark.distributed
def test_copied_run_without_its_data_exports_generates_and_evaluates_as_in_place(moved):
    tmp, results, _ = moved
    in_place, copy = results["in_place"], results["copy"]
    assert in_place["export"] == copy["export"] == 0
    ours, theirs = (
        load_file(tmp / "launch" / "hf-in" / "model.safetensors"),
        load_file(tmp / "third" / "hf-out" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", *TOKENIZER_FILES):
        assert (tmp / "launch" / "hf-in" / name).read_bytes() == (tmp / "third" / "hf-out" / name).read_bytes()
    assert len(in_place["text"]) > len("The os module")
    assert copy["text"] == in_place["text"]
    assert {k: v for k, v in copy["eval"].items() if k != "model"} == {
        k: v for k, v in in_place["eval"].items() if k != "model"
    }


@pytest.mark.distributed
def test_eval_of_a_run_finds_its_data_where_it_was_launched_and_says_when_it_is_gone(moved):
    _, results, _ = moved
    own, with_data = results["own_data_from_third"], results["in_place"]["eval"]
    assert [own[k] for k in ("loss", "tokens", "samples")] == [with_data[k] for k in ("loss", "tokens", "samples")]
    gone = results["gone"]
    assert "\n" not in gone
    assert "--data" in gone and "launch/data/corp" in gone


@pytest.mark.distributed
def test_resume_refuses_moved_data_and_a_changed_tokenizer_in_one_line(moved, monkeypatch):
    from dstrain.errors import DstrainError
    from dstrain.train.preflight import checked_inputs
    from dstrain.train.run import parse_args

    tmp, _, argv = moved
    launch = tmp / "launch"
    monkeypatch.chdir(launch)
    before = (launch / "runs" / "rf" / "recipe.yaml").read_bytes()
    with pytest.raises(DstrainError) as refused:
        checked_inputs(parse_args(argv))
    assert "\n" not in str(refused.value)
    assert "data/corp" in str(refused.value) and str((launch / "data" / "corp").resolve()) in str(refused.value)
    assert (launch / "runs" / "rf" / "recipe.yaml").read_bytes() == before

    # The data back, but the run's tokenizer/ is not the one the data was prepared with any more.
    copy_prepared(tmp / "moved" / "corp", launch / "data" / "corp")
    checked_inputs(parse_args(argv))  # resumable as it is
    tokenizer_json = launch / "runs" / "rf" / "tokenizer" / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["added_tokens"][0]["content"] = "<|other|>"
    tokenizer_json.write_text(json.dumps(spec))
    with pytest.raises(DstrainError, match=r"the tokenizer this run started with.*manifest.json tokenizer.hash"):
        checked_inputs(parse_args(argv))


def test_a_tokenizer_path_that_exists_nowhere_is_named_as_a_path(tmp_path, monkeypatch):
    from dstrain.data.tokenizer import load_tokenizer
    from dstrain.errors import DstrainError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DstrainError) as missing:
        load_tokenizer("data/pydocs/tokenizer", flag="the run's tokenizer")
    message = str(missing.value)
    assert "no such folder" in message and str(tmp_path) in message
    assert "hf download" not in message and "Hub" not in message
    with pytest.raises(DstrainError, match=r"'org/name' \(--tokenizer\) is no folder under .* could not be found"):
        load_tokenizer("org/name")


def test_launch_record_round_trips_and_a_recipe_without_one_is_named(corpus, tmp_path, monkeypatch):
    import yaml

    from dstrain.config import to_dict
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.run_dir import LAUNCH_KEY, LaunchRecord
    from dstrain.train.run_folder import launch_record

    monkeypatch.chdir(tmp_path)
    copy_prepared(corpus, tmp_path / "data" / "corp")
    recipe = load_recipe(small_recipe(tmp_path, Path("data/corp")))
    written = tmp_path / "recipe.yaml"
    record = launch_record(recipe)
    written.write_text(yaml.safe_dump({**to_dict(recipe), LAUNCH_KEY: dataclasses.asdict(record)}))
    assert LaunchRecord.read(written) == record
    assert record == LaunchRecord(str(tmp_path), {"data.sources[0].path": str(tmp_path / "data" / "corp")})

    written.write_text(yaml.safe_dump(to_dict(recipe)))  # a recipe, not a run's record of one
    with pytest.raises(DstrainError, match=rf"^{written}: no readable `launch` record .* name the run folder"):
        LaunchRecord.read(written)


def test_run_dir_find_tells_a_run_from_any_other_folder(tmp_path):
    from dstrain.run_dir import RunDir

    assert RunDir.find(tmp_path) is None  # a Hugging Face folder, prepared data, an empty folder: no recipe.yaml
    assert RunDir.find(tmp_path / "absent") is None
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    assert RunDir.find(str(tmp_path)) == RunDir(tmp_path)
