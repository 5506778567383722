"""The catalogue of bad input to `dstrain.train` in the recipe, its data, the run folder and init_from: one case per
input, each a single line on stderr naming what is wrong and how to fix it, exit status 2, before any work, with
nothing the user had changed (tests/bad_input.py)."""

import pytest

from bad_input import (
    assert_one_line,
    damaged_corpus,
    edit_recipe,
    existing_run,
    folder_with,
    hf_config,
    no_fp16,  # noqa: F401  (a fixture: pytestmark)
    other_data,
    other_tokenizer,
    override,
    refuses_to_train,
    truncate,
    write,
    write_bytes,
)
from data_fixtures import copy_prepared
from train_helpers import ROOT, ds_config, small_recipe

pytestmark = pytest.mark.usefixtures("no_fp16")  # each case is this CPU's answer, on a GPU node too

# name -> (build(tmp_path, corpus) -> (recipe, ds_config, extra argv), fragments the one line must contain)
CASES = {
    "malformed YAML": (
        lambda t, c: (write(t / "r.yaml", "name: x\nmodel: {flavour: llama,\n"), ROOT / "ds_configs/zero1.json", []),
        ["r.yaml: malformed YAML at line"],
    ),
    "override that is not YAML": (
        override("data.stages=[{weights: [0.5]"),
        ["override 'data.stages=[{weights: [0.5]'", "is not a YAML value", "brackets"],
    ),
    "recipe not text": (
        lambda t, c: (write_bytes(t / "r.yaml", b"\x80\xff\x00"), ROOT / "ds_configs/zero1.json", []),
        ["r.yaml: not a text file"],
    ),
    "unknown recipe key": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "optim", weight_decy=0.1), ROOT / "ds_configs/zero1.json", []),
        ["unknown key optim.weight_decy; did you mean optim.weight_decay?"],
    ),
    "wrong type": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "train", steps="ten"), ROOT / "ds_configs/zero1.json", []),
        ["train.steps must be int"],
    ),
    "unprepared data folder": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(t / "nowhere")}]),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["no manifest", "run `dstrain prepare"],
    ),
    "missing shard": (
        lambda t, c: (
            edit_recipe(
                small_recipe(t, c),
                "data",
                sources=[{"path": str(damaged_corpus(t, c, lambda f: (f / "shard_00001.bin").unlink()))}],
            ),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["shard_00001.bin"],
    ),
    "truncated shard": (
        lambda t, c: (
            edit_recipe(
                small_recipe(t, c),
                "data",
                sources=[{"path": str(damaged_corpus(t, c, lambda f: truncate(f / "shard_00000.bin")))}],
            ),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["shard_00000.bin", "dstrain prepare"],
    ),
    "vocabulary smaller than the data's": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "model", vocab_size=256), ROOT / "ds_configs/zero1.json", []),
        ["model.vocab_size=256 is smaller than the tokenizer's 512"],
    ),
    "tokenizer other than the data's": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "data", tokenizer=str(other_tokenizer(t))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["has another tokenizer than the one", "was prepared with"],
    ),
    "sources of two tokenizers": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(c)}, {"path": str(other_data(t))}]),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["small.yaml: data.sources ", "has another tokenizer than the one", "same --tokenizer"],
    ),
    "seq_len above the model's positions": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "model", max_seq_len=16), ROOT / "ds_configs/zero1.json", []),
        ["data.seq_len=32 exceeds model.max_seq_len=16"],
    ),
    "activation checkpointing in the recipe (a ds_config setting)": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "model", activation_checkpointing=True),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["model.activation_checkpointing is a ds_config setting", '"activation_checkpointing": {'],
    ),
    "activation checkpointing off in the recipe (a ds_config setting)": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "model", activation_checkpointing=False),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["model.activation_checkpointing is a ds_config setting", '"activation_checkpointing": {'],
    ),
    "run_dir holding a different model": (
        lambda t, c: (
            small_recipe(t, c),
            ROOT / "ds_configs/zero1.json",
            [f"run_dir={existing_run(t, c, d_model=32)}"],
        ),
        ["holds a run of a different recipe (model", "set run_dir="],
    ),
    "recipe that is a folder": (
        lambda t, c: (ROOT / "recipes", ROOT / "ds_configs/zero1.json", []),
        ["recipes: cannot read the recipe (Is a directory)"],
    ),
    # Numeric ranges (dstrain.ranges), declared with each field.
    "log_interval 0": (override("train.log_interval=0"), ["train.log_interval=0 is out of range", ">= 1"]),
    "eval_samples 0": (override("train.eval_samples=0"), ["train.eval_samples=0 is out of range", ">= 1"]),
    "negative learning rate": (override("optim.lr=-0.001"), ["optim.lr=-0.001 is out of range", "> 0"]),
    "valid_fraction 1": (override("data.valid_fraction=1.0"), ["data.valid_fraction=1.0", "> 0 and < 1"]),
    "beta of 1": (override("optim.betas=[0.9, 1.0]"), ["optim.betas[1]=1.0", "< 1"]),
    "keep_last 0": (override("train.keep_last=0"), ["train.keep_last=0", ">= 1"]),
    "spike factor 1": (override("train.spike_guard.factor=1"), ["train.spike_guard.factor=1.0", "> 1"]),
    "watchdog floor above ceiling": (
        override("train.watchdog={floor_s: 100, ceiling_s: 50}"),
        ["train.watchdog.floor_s=100 exceeds train.watchdog.ceiling_s=50", "lower floor_s or raise ceiling_s"],
    ),
    "negative steps": (override("train.steps=-5"), ["train.steps=-5", ">= 0"]),
    "negative seed": (override("seed=-1"), ["seed=-1", ">= 0"]),
    "zero source weight": (
        override(f"data.sources=[{{path: {'{corpus}'}, weight: 0}}]"),
        ["every data.sources weight is 0", "give at least one source a positive weight"],
    ),
    "decay_fraction above 1": (override("schedule.decay_fraction=2"), ["schedule.decay_fraction=2.0", "<= 1"]),
    "zero model layers": (override("model.n_layer=0"), ["model.n_layer=0", ">= 1"]),
    "zero norm epsilon": (override("model.norm_eps=0"), ["model.norm_eps=0.0", "> 0"]),
    # Natural slips.
    "sources as plain strings": (
        override("data.sources=[{corpus}]"),
        ["data.sources[0] must be a mapping", "- path: "],
    ),
    "sources as one string": (override("data.sources={corpus}"), ["data.sources must be a list"]),
    "override without a value": (override("train.steps"), ["override 'train.steps'", "key=value"]),
    "override into a value": (override("name.first=x"), ["override 'name.first=x'", "name in", "not a section"]),
    "options after the overrides, still checked": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero1", zero_optimisation={}),
            ["train.steps=2", "--resume", "none"],
        ),
        ['unknown key "zero_optimisation"'],
    ),
    # Work before validation: the run folder and init_from are checked before the process group starts.
    "run_dir that is a file": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [f"run_dir={write(t / 'notes.txt', 'x')}"]),
        ["notes.txt is a file", "set run_dir="],
    ),
    "run_dir under a file": (
        lambda t, c: (
            small_recipe(t, c),
            ROOT / "ds_configs/zero1.json",
            [f"run_dir={write(t / 'notes.txt', 'x')}/run"],
        ),
        ["cannot be created", "notes.txt is a file"],
    ),
    "run_dir that is prepared data": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [f"run_dir={copy_prepared(c, t / 'data')}"]),
        ["is a folder prepared by dstrain prepare", "set run_dir="],
    ),
    "run_dir holding someone's files": (
        lambda t, c: (
            small_recipe(t, c),
            ROOT / "ds_configs/zero1.json",
            [f"run_dir={folder_with(t / 'mine', 'thesis.tex')}"],
        ),
        ["holds files that no run wrote (thesis.tex)"],
    ),
    "init_from a missing folder": (
        lambda t, c: (small_recipe(t, c, init_from=str(t / "no-model")), ROOT / "ds_configs/zero1.json", []),
        ["init_from", "no-model/config.json: no such file"],
    ),
    "init_from a folder that is not a model": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(folder_with(t / "empty", "README"))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["init_from", "config.json: no such file"],
    ),
    "init_from a dstrain run without a checkpoint": (
        lambda t, c: (small_recipe(t, c, init_from=existing_run(t, c)), ROOT / "ds_configs/zero1.json", []),
        ["init_from", "checkpoints: no complete checkpoint"],
    ),
    "init_from a model without weights": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(hf_config(t, weights=False))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["init_from", "no weights"],
    ),
    "MoE top_k above num_experts": (
        lambda t, c: (
            small_recipe(t, c, model={"moe": {"num_experts": 2, "top_k": 3}}),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["model.moe.top_k: 3 exceeds num_experts=2", "set top_k <= num_experts"],
    ),
    "init_from another architecture": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(hf_config(t, weights=True))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["init_from", "has another architecture", "model.d_model=64 vs 32"],
    ),
    "init_from an unsupported architecture": (
        lambda t, c: (
            small_recipe(
                t,
                c,
                init_from=str(
                    folder_with(
                        t / "bert",
                        "model.safetensors",
                        config={"model_type": "bert", "architectures": ["BertForMaskedLM"]},
                    )
                ),
            ),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["init_from", "BertForMaskedLM", "cannot be converted"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, corpus, capsys, monkeypatch):
    refuses_to_train(CASES[case], tmp_path, corpus, capsys, monkeypatch)


def test_a_full_disk_is_reported_before_training(monkeypatch, tmp_path):
    import shutil

    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.train.run_folder import check_disk

    recipe = load_recipe(ROOT / "recipes" / "gpt2-125m.yaml")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 10**8, 10**8))
    with pytest.raises(DstrainError, match=r"0\.1 GiB free, one checkpoint needs ~1\.\d GiB"):
        check_disk(tmp_path, recipe)


def test_a_refusal_under_srun_is_printed_by_one_task(tmp_path, corpus, capsys, monkeypatch):
    """srun exports SLURM_PROCID / SLURM_NTASKS, not RANK: each task reads its rank from them before it prints."""
    from dstrain.train.run import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    recipe, config, extra = CASES["unknown recipe key"][0](tmp_path, corpus)
    for task in ("0", "1"):
        monkeypatch.setenv("SLURM_PROCID", task)
        monkeypatch.setenv("SLURM_LOCALID", task)
        assert main(["--recipe", str(recipe), "--deepspeed_config", str(config), *extra]) == 2
    assert_one_line(capsys.readouterr().err, "dstrain: error: ", CASES["unknown recipe key"][1])
