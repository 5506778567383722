"""Bad input to the `dstrain` commands, and to both commands as a user runs them (a process of their own): one line
on stderr, exit status 2, before any work, with nothing the user had changed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bad_input import (
    assert_one_line,
    edit_recipe,
    no_fp16,  # noqa: F401  (a fixture: pytestmark)
    snapshot,
    tasks_of_a_binary_file,
    write,
)
from train_helpers import ROOT, ds_config, small_recipe

pytestmark = pytest.mark.usefixtures("no_fp16")  # each case is this CPU's answer, on a GPU node too


@pytest.mark.launcher
@pytest.mark.parametrize("command", ["train with options after the overrides", "prepare into a file"])
def test_the_cli_reports_bad_input_the_same_way(command, tmp_path, corpus):
    """As a user runs it: a process of its own, so the exit status is the interpreter's, not a return value."""
    recipe = edit_recipe(small_recipe(tmp_path, corpus), "optim", learning_rate=1e-3)
    argv = {
        "train with options after the overrides": [
            "dstrain.train",
            "--recipe",
            str(recipe),
            "train.steps=2",
            "--deepspeed_config",
            str(ROOT / "ds_configs/zero1.json"),
            f"run_dir={tmp_path / 'run'}",
            "--resume",
            "none",
        ],
        "prepare into a file": [
            "dstrain",
            "prepare",
            "--dataset",
            "x.jsonl",
            "--train-tokenizer",
            "512",
            "--out",
            str(recipe),
        ],
    }[command]
    before = snapshot(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WORLD_SIZE": "2"},
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line(
        proc.stderr, "dstrain: error: ", ["optim.learning_rate" if "train" in command else "small.yaml is a file"]
    )
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def same_size_corpus(tmp_path_factory):
    """Other documents, a tokenizer trained on them with the tiny corpus's vocabulary size: same ids, other tokens."""
    from data_fixtures import TINY_VOCAB, prepared_corpus

    return prepared_corpus(tmp_path_factory.mktemp("same_size"), n_docs=60, vocab_size=TINY_VOCAB, skip_docs=300)


def _run_folder(tmp_path, corpus) -> Path:
    """A run folder's recipe.yaml and tokenizer/ (its checkpoint is never read: the refusal comes first)."""
    import shutil

    from dstrain.config import to_dict
    from dstrain.recipe_file import load_recipe

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(to_dict(load_recipe(small_recipe(tmp_path, corpus)))))
    shutil.copytree(Path(corpus) / "tokenizer", run / "tokenizer")  # as the run's start copies it
    return run


def _estimate(t, c, *args):
    return [
        "estimate",
        "--recipe",
        str(small_recipe(t, c)),
        "--deepspeed_config",
        str(ROOT / "ds_configs/zero1.json"),
        *args,
    ]


def _compare(t, c, *args):
    return ["compare", "--recipe", str(small_recipe(t, c)), "--out", str(t / "report"), *args]


# `dstrain <command>` cases: name -> (argv(tmp_path, corpus, other corpus), fragments)
CLI_CASES = {
    "prepare --out naming a file": (
        lambda t, c, o: [
            "prepare",
            "--dataset",
            "x.jsonl",
            "--train-tokenizer",
            "512",
            "--out",
            str(write(t / "f", "x")),
        ],
        ["--out", "/f is a file"],
    ),
    "plan with an override that is not YAML": (
        lambda t, c, o: ["plan", "--recipe", str(small_recipe(t, c)), "train.steps=[1"],
        ["override 'train.steps=[1'", "is not a YAML value"],
    ),
    "prepare --out under a file": (
        lambda t, c, o: [
            "prepare",
            "--dataset",
            "x.jsonl",
            "--train-tokenizer",
            "512",
            "--out",
            f"{write(t / 'f', 'x')}/d",
        ],
        ["is under", "/f, a file"],
    ),
    "eval --samples 0": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--samples", "0"],
        ["--samples 0: must be positive"],
    ),
    "eval --micro-batch -1": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--micro-batch", "-1"],
        ["--micro-batch -1: must be positive"],
    ),
    "eval of a run on data of another tokenizer of the same size": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--data", str(o)],
        ["the run ", "has another tokenizer than the one --data", "--tokenizer"],
    ),
    "eval --tasks of malformed YAML": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--tasks", str(write(t / "tasks.yaml", "- {name: piqa,\n"))],
        ["tasks.yaml: malformed YAML at line"],
    ),
    "eval --tasks naming a file that is not text": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--tasks", str(tasks_of_a_binary_file(t))],
        ["p.jsonl line 1 is not UTF-8 text"],
    ),
    "compare --nproc 0": (
        lambda t, c, o: _compare(t, c, "--nproc", "0", "--deepspeed_configs", str(ROOT / "ds_configs/zero1.json")),
        ["--nproc 0", "positive"],
    ),
    "compare --steps -3": (
        lambda t, c, o: _compare(
            t, c, "--nproc", "2", "--steps", "-3", "--deepspeed_configs", str(ROOT / "ds_configs/zero1.json")
        ),
        ["--steps -3", "positive"],
    ),
    "compare with a missing ds_config after a good one": (
        lambda t, c, o: _compare(
            t, c, "--nproc", "2", "--deepspeed_configs", str(ROOT / "ds_configs/zero1.json"), str(t / "zero9.json")
        ),
        ["zero9.json: no such ds_config file"],
    ),
    "compare with ZeRO stage 7 after a good one": (
        lambda t, c, o: _compare(
            t,
            c,
            "--nproc",
            "2",
            "--deepspeed_configs",
            str(ROOT / "ds_configs/zero1.json"),
            str(ds_config(t, "zero1", zero_optimization={"stage": 7})),
        ),
        ["zero_optimization.stage=7"],
    ),
    "compare with a micro-batch that does not divide the global batch": (
        lambda t, c, o: _compare(
            t,
            c,
            "--nproc",
            "2",
            "--deepspeed_configs",
            str(ROOT / "ds_configs/zero0.json"),
            str(ds_config(t, "zero1", train_micro_batch_size_per_gpu=3)),
        ),
        ["train_micro_batch_size_per_gpu=3", "valid micro-batch sizes for 2 ranks: 1, 2, 4"],
    ),
    "compare with a misspelled key in one config": (
        lambda t, c, o: _compare(
            t,
            c,
            "--nproc",
            "2",
            "--deepspeed_configs",
            str(ROOT / "ds_configs/zero1.json"),
            str(ds_config(t, "zero2", zero_optimization={"stage": 2, "contiguous_gradient": True})),
        ),
        ['"zero_optimization.contiguous_gradient"', '"zero_optimization.contiguous_gradients"'],
    ),
    "estimate --configs-dir naming a missing folder": (
        lambda t, c, o: _estimate(t, c, "--configs-dir", str(t / "configs")),
        ["--configs-dir", "no such folder"],
    ),
    "estimate --device-memory 0": (
        lambda t, c, o: _estimate(t, c, "--device-memory", "0"),
        ["--device-memory 0", "positive"],
    ),
    "estimate --reserve above the device": (
        lambda t, c, o: _estimate(t, c, "--device-memory", "16", "--reserve", "20"),
        ["--reserve 20", "below"],
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_commands_refuse_bad_input_before_any_work(case, tmp_path, corpus, same_size_corpus, capsys):
    from dstrain.commands.cli import main

    build, fragments = CLI_CASES[case]
    argv = build(tmp_path, corpus, same_size_corpus)
    before = snapshot(tmp_path)
    assert main(argv) == 2
    assert_one_line(capsys.readouterr().err, "dstrain: error: ", fragments)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["dstrain.train", "--recipe", "r.yaml", "--deepspeed_config", "d.json", "--resme", "none"],
            ["dstrain.train: error: unrecognized arguments: --resme", "--help"],
        ),
        (
            ["dstrain.train", "--deepspeed_config", "d.json", "train.steps=2"],
            ["the following arguments are required: --recipe"],
        ),
        (["dstrain", "compare", "--nproc", "two"], ["argument --nproc: invalid int value: 'two'"]),
        (["dstrain", "evaluate", "runs/x"], ["dstrain: error: argument command: invalid choice: 'evaluate'"]),
    ],
)
def test_argument_errors_are_one_line(argv, fragments, capsys):
    from dstrain.commands.cli import main as cli_main
    from dstrain.train.run import main as train_main

    with pytest.raises(SystemExit) as exit_:
        (train_main if argv[0] == "dstrain.train" else cli_main)(argv[1:])
    assert exit_.value.code == 2
    assert_one_line(capsys.readouterr().err, argv[0], fragments)
