"""Zero is a value (design.md invariant 15, issue 55 §6): an option or field given as 0, "" or false is used as given
(or refused in one line where it cannot mean anything), never replaced by a default. Each row passes the zero value
through the real resolution code and checks what came out; the last test keeps `args.x or default` out of commands/.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from chat_fixtures import CONVERSATIONS
from test_pairs_data import conversational_rows, prepared_pairs

from dstrain.errors import DstrainError

from train_helpers import small_recipe

ROOT = Path(__file__).resolve().parents[1]


# --- dstrain eval -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory):
    """A pair folder of 6 pairs and a random Hugging Face model over its tokenizer."""
    import torch

    from dstrain.data.manifest import read_manifest
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    tmp = tmp_path_factory.mktemp("pairs")
    rows = conversational_rows(implicit=False) * 2
    out, _, _ = prepared_pairs(tmp, rows)
    vocab = -(-read_manifest(out).vocab_size // 64) * 64
    config = GPTConfig(flavour="llama", vocab_size=vocab, max_seq_len=320, n_layer=1, n_head=2, d_model=32)
    torch.manual_seed(0)
    to_hf_model(config, GPT(config).state_dict()).save_pretrained(tmp / "policy")
    return {"data": out, "model": tmp / "policy", "pairs": len(rows)}


def eval_pairs(pair_model, capsys, *flags: str) -> dict:
    from dstrain.commands.cli import main

    argv = ["eval", str(pair_model["model"]), "--data", str(pair_model["data"]), "--loss", "simpo", "--seq-len", "320"]
    capsys.readouterr()
    assert main([*argv, "--split", "train", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_pairs_valid_fraction_0_counts_every_pair(pair_model, capsys):
    """`--valid-fraction 0 --split train` evaluates every pair; the default (0.01) holds one out (at least one
    document goes to a non-empty valid split), so the 0 is what was used."""
    assert len(CONVERSATIONS) * 2 == pair_model["pairs"]
    assert eval_pairs(pair_model, capsys, "--valid-fraction", "0")["pairs"] == pair_model["pairs"]
    assert eval_pairs(pair_model, capsys)["pairs"] == pair_model["pairs"] - 1


def test_eval_pairs_seed_0_is_the_split_seed(pair_model, capsys, monkeypatch):
    """`--seed 0` reaches the split as 0 (not the default 1234)."""
    from dstrain.data import dataset

    seeds = []
    build = dataset.build_dataset

    def recording(sources, split, seq_len, seed, *args, **kwargs):
        seeds.append(seed)
        return build(sources, split, seq_len, seed, *args, **kwargs)

    monkeypatch.setattr(dataset, "build_dataset", recording)
    eval_pairs(pair_model, capsys, "--seed", "0", "--valid-fraction", "0.5")
    assert seeds and set(seeds) == {0}


@pytest.mark.parametrize("flags", [["--tasks"], ["--tasks", "--harness"], []])
def test_eval_micro_batch_0_is_refused_not_replaced(tmp_path, capsys, flags):
    """`--micro-batch 0` on every path of `dstrain eval` (loss, tasks, harness) is one line, before anything is
    read: the harness path used to run at the default micro-batch of 4."""
    from dstrain.commands.cli import main

    assert main(["eval", str(tmp_path / "absent"), "--micro-batch", "0", *flags]) == 2
    assert capsys.readouterr().err.strip().endswith("--micro-batch 0: must be positive")


# --- recipe fields and key=value overrides ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, fix",
    [
        ("name=''", "name is empty; name the run"),
        ("run_dir=''", "run_dir is empty; name a folder, or remove the key for runs/<name>"),
        ("data.tokenizer=''", "data.tokenizer is empty; name a tokenizer folder"),
        ("init_from=''", "init_from is empty; name a model folder or run"),
    ],
)
def test_an_empty_path_or_name_is_refused_not_read_as_absent(tmp_path, corpus, override, fix):
    """ "" as a run folder, tokenizer, init_from or name was read as absent (runs/<name>, the data's tokenizer, no
    init_from), and an empty name made runs/ itself the run folder: now one line naming the file and key."""
    from dstrain.recipe_file import load_recipe

    recipe = small_recipe(tmp_path, corpus)
    with pytest.raises(DstrainError) as e:
        load_recipe(recipe, [override])
    assert str(e.value).startswith(f"{recipe}: {fix}")


def test_zero_overrides_reach_the_recipe_and_the_ds_config(tmp_path, corpus):
    """key=value overrides of 0 over a recipe that sets them otherwise: the recipe holds the 0s and DeepSpeed is
    handed them (gradient_clipping 0: no clipping; weight_decay 0), seed 0 included."""
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import resolve

    recipe_file = small_recipe(
        tmp_path,
        corpus,
        seed=5,
        train={"eval_interval": 5, "checkpoint_interval": 5},
        optim={"grad_clip": 0.5, "weight_decay": 0.1, "min_lr": 1e-4},
        schedule={"warmup_steps": 2},
    )
    zeros = {
        "seed": 0,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
        "optim.grad_clip": 0,
        "optim.weight_decay": 0,
        "optim.min_lr": 0,
        "schedule.warmup_steps": 0,
    }
    recipe = load_recipe(recipe_file, [f"{k}={v}" for k, v in zeros.items()])
    for key, zero in zeros.items():
        section, _, name = key.rpartition(".")
        assert getattr(getattr(recipe, section) if section else recipe, name) == zero, key
    config = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    resolved = resolve(recipe, recipe_file, config, "zero1.json", 2, check_device=False).deepspeed_config
    assert resolved["gradient_clipping"] == 0
    assert resolved["optimizer"]["params"]["weight_decay"] == 0
    assert resolved["seed"] == 0


# --- ds_config fields --------------------------------------------------------------------------------------------


def pipeline_strategy(tmp_path, corpus, **changes):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import resolve

    recipe_file = small_recipe(tmp_path, corpus)
    config = json.loads((ROOT / "ds_configs" / "pp2_zero1.json").read_text())
    config.update(changes)
    return resolve(load_recipe(recipe_file), recipe_file, config, "pp.json", 2, check_device=False)


def test_pipeline_checkpoint_interval_0_is_off_and_never_overruled(tmp_path, corpus):
    """pipeline.activation_checkpoint_interval: 0 builds no checkpointing; left out beside an activation_checkpointing
    section it is every block (1); an explicit 0 beside the section was silently made 1: now refused in one line."""
    off = pipeline_strategy(tmp_path, corpus)
    assert (off.pipe_checkpoint_interval, off.activation_checkpointing) == (0, False)
    section = {"activation_checkpointing": {"partition_activations": False}}
    every = pipeline_strategy(tmp_path, corpus, pipeline={"stages": 2}, **section)
    assert (every.pipe_checkpoint_interval, every.activation_checkpointing) == (1, True)
    with pytest.raises(DstrainError, match="activation_checkpoint_interval=0 turns activation checkpointing off"):
        pipeline_strategy(tmp_path, corpus, **section)


def test_monitor_output_path_empty_is_deepspeeds_working_directory(tmp_path):
    """tensorboard/csv_monitor output_path "" is DeepSpeed's own default (the working directory), not the run
    folder it used to become."""
    from dstrain.monitors.settings import monitor_settings

    config = {"csv_monitor": {"enabled": True, "output_path": "", "job_name": "job"}}
    assert monitor_settings(config, tmp_path / "run", {}).csv == Path("job")
    config = {"tensorboard": {"enabled": True, "output_path": "", "job_name": "job"}}
    assert monitor_settings(config, tmp_path / "run", {}).tensorboard == Path("job")


@pytest.mark.parametrize(
    "key, variable", [("project", "WANDB_PROJECT"), ("team", "WANDB_ENTITY"), ("group", "WANDB_RUN_GROUP")]
)
def test_wandb_names_are_the_blocks_and_an_empty_one_is_refused(tmp_path, key, variable):
    """The wandb block's project/team/group wins over W&B's variable; "" was replaced by the variable (or the
    default project) in silence: now one line."""
    from dstrain.errors import naming_files
    from dstrain.monitors.settings import check_monitors, monitor_settings

    env = {variable: "from-env", "WANDB_MODE": "offline"}
    settings = monitor_settings({"wandb": {"enabled": True, key: "from-block"}}, tmp_path, env).wandb
    assert getattr(settings, {"team": "entity"}.get(key, key)) == "from-block"
    with pytest.raises(DstrainError, match=f'd.json: wandb.{key} is ""; name one, or remove the key to use {variable}'):
        with naming_files(ds_config="d.json"):
            check_monitors({"wandb": {"enabled": True, key: ""}}, tmp_path, env)


# --- the lint ------------------------------------------------------------------------------------------------------


def falsy_defaults(source: str) -> list[str]:
    """`args.x or default` and `args.x if args.x else default` in a module: each replaces a 0, "" or false the user
    gave (use dstrain.options.given)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            operands = node.values[:-1]
        elif isinstance(node, ast.IfExp) and ast.dump(node.test) == ast.dump(node.body):
            operands = [node.test]
        else:
            continue
        for operand in operands:
            if isinstance(operand, ast.Attribute) and isinstance(operand.value, ast.Name):
                if operand.value.id in ("args", "opts", "options"):
                    found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_the_lint_finds_the_pattern():
    assert falsy_defaults("x = args.valid_fraction or 0.01\ny = args.seed if args.seed else 1\nz = given(args.a, 1)\n")
    assert len(falsy_defaults("x = args.valid_fraction or 0.01\ny = args.seed if args.seed else 1\n")) == 2
    assert not falsy_defaults("x = given(args.a, 1)\ny = args.a if args.a is not None else 1\nz = a.b or 1\n")


def test_no_command_replaces_a_falsy_option_with_a_default():
    commands = list((ROOT / "src" / "dstrain" / "commands").glob("*.py"))
    files = sorted(commands) + [ROOT / "src/dstrain/train/run.py"]
    found = {f.name: hits for f in files if (hits := falsy_defaults(f.read_text()))}
    assert not found, f"use dstrain.options.given: {found}"
