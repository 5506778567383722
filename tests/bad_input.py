"""The pieces of the bad-input catalogues (tests/test_bad_input*.py): builders of bad files and folders, and the
checks every case makes: one line on stderr, exit status 2, nothing the user had changed."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from data_fixtures import copy_prepared
from train_helpers import ROOT, small_recipe


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


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def tasks_of_a_binary_file(folder: Path) -> Path:
    items = write_bytes(folder / "p.jsonl", b"\xff\xfe")
    return write(folder / "tasks.yaml", f"- {{name: piqa, format: piqa, path: {items}}}\n")


def other_tokenizer(tmp_path) -> Path:
    from data_fixtures import prepared_corpus

    return prepared_corpus(tmp_path / "other", n_docs=50, vocab_size=300) / "tokenizer"


def other_data(tmp_path) -> Path:
    return other_tokenizer(tmp_path).parent


def existing_run(tmp_path, corpus, **model) -> str:
    """A run directory whose recipe.yaml records another model shape, as an earlier run leaves it (every field)."""
    from dstrain.config import to_dict
    from dstrain.recipe_file import load_recipe

    run = tmp_path / "run"
    run.mkdir()
    recipe = to_dict(load_recipe(small_recipe(tmp_path, corpus, name="earlier")))
    recipe["model"].update(model)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(run)


def override(item: str):
    """A case: the small recipe with one override ({corpus} stands for the prepared corpus)."""
    return lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [item.replace("{corpus}", str(c))])


def folder_with(folder: Path, *names: str, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("x")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_config(tmp_path, weights: bool) -> Path:
    """A Llama folder like the small recipe's model but half as wide; weights=True adds a (placeholder) weights file."""
    from transformers import LlamaConfig

    folder = tmp_path / "hf"
    LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def finished_run(tmp_path, corpus) -> Path:
    """A run folder as a finished 10-step run of the small recipe leaves it (without its checkpoint)."""
    from dstrain.config import to_dict
    from dstrain.recipe_file import load_recipe

    run = tmp_path / "finished"
    (run / "checkpoints").mkdir(parents=True)
    recipe = load_recipe(small_recipe(tmp_path, corpus, name="finished"))
    (run / "recipe.yaml").write_text(yaml.safe_dump(to_dict(recipe)))
    (run / "ds_config.json").write_text((ROOT / "ds_configs/zero2.json").read_text())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in range(1, 11)))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "step": 10}))
    (run / "checkpoints" / "latest").write_text("global_step10")
    return run


def snapshot(folder: Path) -> dict:
    """Every path under folder with its mtime, and each file's content hash: nothing created, changed or removed."""
    return {
        str(p): (p.stat().st_mtime_ns, p.is_dir() or hashlib.sha256(p.read_bytes()).hexdigest())
        for p in folder.rglob("*")
    }


def assert_one_line(err: str, prefix: str, fragments) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def no_fp16(monkeypatch):
    """Every case is about this CPU's answer; a GPU node with fp16 must give the same one."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)


def refuses_to_train(case: tuple, tmp_path: Path, corpus: Path, capsys, monkeypatch) -> None:
    """``case``: (build(tmp_path, corpus) -> (recipe, ds_config, extra argv), fragments the one line must contain);
    the run goes to tmp_path/run unless the extra argv names a run_dir."""
    from dstrain.train.run import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a 2-rank launcher; nothing reaches the process group
    build, fragments = case
    recipe, config, extra = build(tmp_path, corpus)
    if not any(str(a).startswith("run_dir=") for a in extra):
        extra = [*extra, f"run_dir={tmp_path / 'run'}"]
    before = snapshot(tmp_path)
    assert main(["--recipe", str(recipe), "--deepspeed_config", str(config), *extra]) == 2
    assert_one_line(capsys.readouterr().err, "dstrain: error: ", fragments)
    assert snapshot(tmp_path) == before  # nothing written, nothing touched
