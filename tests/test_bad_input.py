"""The catalogue of bad input to `dstrain.train`: one case per input, each a single line on stderr naming
what is wrong and how to fix it, exit status 2, before any work, with nothing the user had changed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_fixtures import copy_prepared
from train_helpers import ROOT, ds_config, small_recipe


def edit_recipe(path: Path, section: str, **values) -> Path:
    recipe = yaml.safe_load(path.read_text())
    recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    return path


def damaged_corpus(tmp_path, corpus, damage) -> Path:
    folder = copy_prepared(corpus, tmp_path / "damaged")
    damage(folder)
    return folder


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


# name -> (build(tmp_path, corpus) -> (recipe, ds_config, extra args), fragments the one line must contain)
CASES = {
    "malformed YAML": (
        lambda t, c: (_write(t / "r.yaml", "name: x\nmodel: {flavour: llama,\n"), ROOT / "ds_configs/zero1.json", []),
        ["r.yaml: malformed YAML at line"]),
    "malformed JSON": (
        lambda t, c: (small_recipe(t, c), _write(t / "d.json", '{"zero_optimization": {"stage": 1}'), []),
        ["d.json: malformed JSON at line 1"]),
    "unknown recipe key": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "optim", weight_decy=0.1), ROOT / "ds_configs/zero1.json", []),
        ["unknown key optim.weight_decy; did you mean optim.weight_decay?"]),
    "wrong type": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "train", steps="ten"), ROOT / "ds_configs/zero1.json", []),
        ["train.steps must be int"]),
    "inconsistent batch arithmetic": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", train_micro_batch_size_per_gpu=3), []),
        ["train_micro_batch_size_per_gpu=3", "valid micro-batch sizes for 2 ranks: 1, 2, 4"]),
    "ds_config contradicts the recipe": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", gradient_clipping=5.0), []),
        ["pins gradient_clipping=5.0", "sets optim.grad_clip=1.0"]),
    "pipeline with ZeRO-2": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero2", pipeline={"stages": 2}), []),
        ["pipeline parallelism works with ZeRO stage 0 or 1", "stage to 1"]),
    "fp16 on a device without it": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1_fp16.json", []),
        ["fp16 is not supported on this device", "ds_configs/zero1_bf16.json"]),
    "unprepared data folder": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(t / "nowhere")}]),
                      ROOT / "ds_configs/zero1.json", []),
        ["no manifest", "run `dstrain prepare"]),
    "missing shard": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(damaged_corpus(
            t, c, lambda f: (f / "shard_00001.bin").unlink()))}]), ROOT / "ds_configs/zero1.json", []),
        ["shard_00001.bin"]),
    "truncated shard": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(damaged_corpus(
            t, c, lambda f: truncate(f / "shard_00000.bin")))}]), ROOT / "ds_configs/zero1.json", []),
        ["shard_00000.bin", "dstrain prepare"]),
    "vocabulary smaller than the data's": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "model", vocab_size=256), ROOT / "ds_configs/zero1.json", []),
        ["model.vocab_size=256 is smaller than the tokenizer's 512"]),
    "tokenizer other than the data's": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "data", tokenizer=str(_other_tokenizer(t))),
                      ROOT / "ds_configs/zero1.json", []),
        ["is not the one", "was prepared with"]),
    "seq_len above the model's positions": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "model", max_seq_len=16), ROOT / "ds_configs/zero1.json", []),
        ["data.seq_len=32 exceeds model.max_seq_len=16"]),
    "activation checkpointing in the recipe (a ds_config setting)": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "model", activation_checkpointing=True),
                      ROOT / "ds_configs/zero1.json", []),
        ["model.activation_checkpointing moved to the ds_config", '"activation_checkpointing": {']),
    "run_dir holding a different model": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [_existing_run(t, c, d_model=32)]),
        ["holds a run of a different recipe (model", "set run_dir="]),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _other_tokenizer(tmp_path) -> Path:
    from data_fixtures import prepared_corpus

    return prepared_corpus(tmp_path / "other", n_docs=50, vocab_size=300) / "tokenizer"


def _existing_run(tmp_path, corpus, **model) -> str:
    """A run directory whose recipe.yaml records another model shape, as an earlier run leaves it."""
    run = tmp_path / "run"
    run.mkdir()
    recipe = yaml.safe_load(small_recipe(tmp_path, corpus, name="earlier").read_text())
    recipe["model"].update(model)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(run)


def snapshot(folder: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, corpus, capsys, monkeypatch):
    from dstrain.train.run import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a 2-rank launcher; nothing reaches the process group
    build, fragments = CASES[case]
    recipe, config, extra = build(tmp_path, corpus)
    run_dir = extra[0] if extra else str(tmp_path / "run")
    before = snapshot(tmp_path)
    assert main(["--recipe", str(recipe), "--deepspeed_config", str(config), f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dstrain: error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    assert snapshot(tmp_path) == before  # nothing written, nothing touched


def test_the_cli_reports_bad_input_the_same_way(tmp_path, corpus):
    recipe = edit_recipe(small_recipe(tmp_path, corpus), "optim", learning_rate=1e-3)
    proc = subprocess.run([sys.executable, "-m", "dstrain.train", "--recipe", str(recipe), "--deepspeed_config",
                           str(ROOT / "ds_configs/zero1.json")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "2"})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "optim.learning_rate" in proc.stderr
