"""The catalogue of bad input to `dstrain.train`: one case per input, each a single line on stderr naming
what is wrong and how to fix it, exit status 2, before any work, with nothing the user had changed."""

import hashlib
import json
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


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _tasks_of_a_binary_file(folder: Path) -> Path:
    items = _write_bytes(folder / "p.jsonl", b"\xff\xfe")
    return _write(folder / "tasks.yaml", f"- {{name: piqa, format: piqa, path: {items}}}\n")


def _other_tokenizer(tmp_path) -> Path:
    from data_fixtures import prepared_corpus

    return prepared_corpus(tmp_path / "other", n_docs=50, vocab_size=300) / "tokenizer"


def _other_data(tmp_path) -> Path:
    return _other_tokenizer(tmp_path).parent


def _existing_run(tmp_path, corpus, **model) -> str:
    """A run directory whose recipe.yaml records another model shape, as an earlier run leaves it (every field)."""
    from dstrain.config import load_recipe, to_dict

    run = tmp_path / "run"
    run.mkdir()
    recipe = to_dict(load_recipe(small_recipe(tmp_path, corpus, name="earlier")))
    recipe["model"].update(model)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(run)


def _override(item: str):
    """A case: the small recipe with one override ({corpus} stands for the prepared corpus)."""
    return lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [item.replace("{corpus}", str(c))])


def _folder_with(folder: Path, *names: str, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("x")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _hf_config(tmp_path, weights: bool) -> Path:
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


def _finished_run(tmp_path, corpus) -> Path:
    """A run folder as a finished 10-step run of the small recipe leaves it (without its checkpoint)."""
    from dstrain.config import load_recipe, to_dict

    run = tmp_path / "finished"
    (run / "checkpoints").mkdir(parents=True)
    recipe = load_recipe(small_recipe(tmp_path, corpus, name="finished"))
    (run / "recipe.yaml").write_text(yaml.safe_dump(to_dict(recipe)))
    (run / "ds_config.json").write_text((ROOT / "ds_configs/zero2.json").read_text())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in range(1, 11)))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "step": 10}))
    (run / "checkpoints" / "latest").write_text("global_step10")
    return run


# name -> (build(tmp_path, corpus) -> (recipe, ds_config, extra argv), fragments the one line must contain);
# the run goes to tmp_path/run unless the extra argv names a run_dir.
CASES = {
    "malformed YAML": (
        lambda t, c: (_write(t / "r.yaml", "name: x\nmodel: {flavour: llama,\n"), ROOT / "ds_configs/zero1.json", []),
        ["r.yaml: malformed YAML at line"],
    ),
    "malformed JSON": (
        lambda t, c: (small_recipe(t, c), _write(t / "d.json", '{"zero_optimization": {"stage": 1}'), []),
        ["d.json: malformed JSON at line 1"],
    ),
    "override that is not YAML": (
        _override("data.stages=[{weights: [0.5]"),
        ["override 'data.stages=[{weights: [0.5]'", "is not a YAML value", "brackets"],
    ),
    "recipe not text": (
        lambda t, c: (_write_bytes(t / "r.yaml", b"\x80\xff\x00"), ROOT / "ds_configs/zero1.json", []),
        ["r.yaml: not a text file"],
    ),
    "ds_config not text": (
        lambda t, c: (small_recipe(t, c), _write_bytes(t / "d.json", b"\x80\xff\x00"), []),
        ["d.json: not a text file"],
    ),
    "unknown recipe key": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "optim", weight_decy=0.1), ROOT / "ds_configs/zero1.json", []),
        ["unknown key optim.weight_decy; did you mean optim.weight_decay?"],
    ),
    "wrong type": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "train", steps="ten"), ROOT / "ds_configs/zero1.json", []),
        ["train.steps must be int"],
    ),
    "inconsistent batch arithmetic": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", train_micro_batch_size_per_gpu=3), []),
        ["train_micro_batch_size_per_gpu=3", "valid micro-batch sizes for 2 ranks: 1, 2, 4"],
    ),
    "ds_config contradicts the recipe": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", gradient_clipping=5.0), []),
        ["pins gradient_clipping=5.0", "sets optim.grad_clip=1.0"],
    ),
    "pipeline with ZeRO-2": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero2", pipeline={"stages": 2}), []),
        ["pipeline parallelism works with ZeRO stage 0 or 1", "stage to 1"],
    ),
    "sequence parallelism not dividing the heads": (
        lambda t, c: (small_recipe(t, c, model={"n_kv_head": 1}), ROOT / "ds_configs/sp2_zero1.json", []),
        ["sequence_parallel_size=2 does not divide the 1 heads", "model.n_kv_head"],
    ),
    "sequence parallelism not dividing seq_len": (
        lambda t, c: (edit_recipe(small_recipe(t, c), "data", seq_len=33), ROOT / "ds_configs/sp2_zero1.json", []),
        ["sequence_parallel_size=2 does not divide data.seq_len=33", "multiple of 2"],
    ),
    "sequence parallelism with pipeline stages": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "pp2_zero1", sequence_parallel_size=2), []),
        ["sequence_parallel_size with pipeline.stages > 1", "ds_configs/sp2_zero1.json"],
    ),
    "sequence parallelism with tensor parallelism": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "tp2_zero1", sequence_parallel_size=2), []),
        ["sequence_parallel_size with tensor_parallel", "ds_configs/tp2_zero1.json"],
    ),
    "misspelled tiling key": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", tiling={"los": 4}), []),
        ['unknown key "tiling.los"', '"loss" and "mlp"'],
    ),
    "loss chunks not dividing the sequence": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", tiling={"loss": 5}), []),
        ["tiling.loss=5 does not divide the 32 tokens of a rank's sequence", "use 4 or 8"],
    ),
    "loss chunks not dividing a sequence-parallel rank's slice": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "sp2_zero1", tiling={"loss": 32}), []),
        ["tiling.loss=32", "from 1 (off) to the 16 tokens of a rank's sequence", '"auto"'],
    ),
    "tiled MLP with a mixture of experts": (
        lambda t, c: (
            small_recipe(t, c, model={"moe": {"num_experts": 2, "top_k": 1}}),
            ds_config(t, "zero1", tiling={"mlp": 2}),
            [],
        ),
        ["tiling.mlp with model.moe is not supported", "activation_checkpointing"],
    ),
    "tiled MLP with pipeline stages": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "pp2_zero1", tiling={"mlp": 2}), []),
        ["tiling.mlp with pipeline.stages > 1 is not supported"],
    ),
    "fp16 on a device without it": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1_fp16.json", []),
        ["fp16 is not supported on this device", "ds_configs/zero1_bf16.json"],
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
            edit_recipe(small_recipe(t, c), "data", tokenizer=str(_other_tokenizer(t))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["is not the one", "was prepared with"],
    ),
    "sources of two tokenizers": (
        lambda t, c: (
            edit_recipe(small_recipe(t, c), "data", sources=[{"path": str(c)}, {"path": str(_other_data(t))}]),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["small.yaml: data.sources ", "was prepared with another tokenizer than", "same --tokenizer"],
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
            [f"run_dir={_existing_run(t, c, d_model=32)}"],
        ),
        ["holds a run of a different recipe (model", "set run_dir="],
    ),
    # A ds_config that DeepSpeed would reject inside deepspeed.initialize, or silently ignore.
    "misspelled ZeRO sub-key": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero2", zero_optimization={"stage": 2, "overlap_com": True}),
            [],
        ),
        ['unknown key "zero_optimization.overlap_com"', 'did you mean "zero_optimization.overlap_comm"'],
    ),
    "misspelled top-level key": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", zero_optimisation={"stage": 2}), []),
        ['unknown key "zero_optimisation"', 'did you mean "zero_optimization"'],
    ),
    "misspelled nested offload key": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero2", zero_optimization={"stage": 2, "offload_optimizer": {"devce": "cpu"}}),
            [],
        ),
        ['"zero_optimization.offload_optimizer.devce"', '"zero_optimization.offload_optimizer.device"'],
    ),
    "misspelled bf16 key": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", bf16={"enabeld": True}), []),
        ['unknown key "bf16.enabeld"', '"bf16.enabled"'],
    ),
    "misspelled activation_checkpointing key": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero1", activation_checkpointing={"partition_activation": True}),
            [],
        ),
        ['"activation_checkpointing.partition_activation"', '"activation_checkpointing.partition_activations"'],
    ),
    "misspelled data_types key": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", data_types={"grad_acum_dtype": "fp32"}), []),
        ['"data_types.grad_acum_dtype"', '"data_types.grad_accum_dtype"'],
    ),
    "misspelled monitor key": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", tensorboard={"enabled": True, "output_pat": "tb"}), []),
        ['"tensorboard.output_pat"', '"tensorboard.output_path"'],
    ),
    "misspelled pipeline key": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "pp2_zero1", pipeline={"stages": 2, "partition_methd": "uniform"}),
            [],
        ),
        ['"pipeline.partition_methd"', '"pipeline.partition_method"'],
    ),
    "ZeRO stage as a word": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", zero_optimization={"stage": "two"}), []),
        ["zero_optimization.stage"],
    ),
    "ZeRO stage 7": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", zero_optimization={"stage": 7}), []),
        ["zero_optimization.stage=7", "use 0, 1, 2 or 3"],
    ),
    "ZeRO bucket size of the wrong type": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero1", zero_optimization={"stage": 1, "reduce_bucket_size": "big"}),
            [],
        ),
        ['"zero_optimization.reduce_bucket_size"', "'big'"],
    ),
    "unknown optimizer type": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", optimizer={"type": "AdamWW", "params": {}}), []),
        ['optimizer.type "AdamWW"', 'did you mean "AdamW"'],
    ),
    "ds_config seed that is not the recipe's": (
        lambda t, c: (small_recipe(t, c), ds_config(t, "zero1", seed=99), []),
        ["pins seed=99", "sets seed=7"],
    ),
    "ds_config that is a list": (
        lambda t, c: (small_recipe(t, c), _write(t / "d.json", "[1, 2]"), []),
        ["d.json: a ds_config is a JSON object"],
    ),
    "ds_config that is a folder": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs", []),
        ["ds_configs: cannot read the ds_config (Is a directory)"],
    ),
    "recipe that is a folder": (
        lambda t, c: (ROOT / "recipes", ROOT / "ds_configs/zero1.json", []),
        ["recipes: cannot read the recipe (Is a directory)"],
    ),
    "missing ds_config": (
        lambda t, c: (small_recipe(t, c), t / "nowhere.json", []),
        ["nowhere.json: no such ds_config file"],
    ),
    "finished run extended under a ds_config DeepSpeed rejects": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero2", zero_optimization={"stage": 2, "overlap_com": True}),
            [f"run_dir={_finished_run(t, c)}", "train.steps=20"],
        ),
        ['"zero_optimization.overlap_com"'],
    ),
    # Numeric ranges (dstrain.ranges), declared with each field.
    "log_interval 0": (_override("train.log_interval=0"), ["train.log_interval=0 is out of range", ">= 1"]),
    "eval_samples 0": (_override("train.eval_samples=0"), ["train.eval_samples=0 is out of range", ">= 1"]),
    "negative learning rate": (_override("optim.lr=-0.001"), ["optim.lr=-0.001 is out of range", "> 0"]),
    "valid_fraction 1": (_override("data.valid_fraction=1.0"), ["data.valid_fraction=1.0", "> 0 and < 1"]),
    "beta of 1": (_override("optim.betas=[0.9, 1.0]"), ["optim.betas[1]=1.0", "< 1"]),
    "keep_last 0": (_override("train.keep_last=0"), ["train.keep_last=0", ">= 1"]),
    "spike factor 1": (_override("train.spike_guard.factor=1"), ["train.spike_guard.factor=1.0", "> 1"]),
    "watchdog floor above ceiling": (
        _override("train.watchdog={floor_s: 100, ceiling_s: 50}"),
        ["train.watchdog.floor_s=100 exceeds train.watchdog.ceiling_s=50", "lower floor_s or raise ceiling_s"],
    ),
    "negative steps": (_override("train.steps=-5"), ["train.steps=-5", ">= 0"]),
    "negative seed": (_override("seed=-1"), ["seed=-1", ">= 0"]),
    "zero source weight": (
        _override(f"data.sources=[{{path: {'{corpus}'}, weight: 0}}]"),
        ["every data.sources weight is 0", "give at least one source a positive weight"],
    ),
    "decay_fraction above 1": (_override("schedule.decay_fraction=2"), ["schedule.decay_fraction=2.0", "<= 1"]),
    "zero model layers": (_override("model.n_layer=0"), ["model.n_layer=0", ">= 1"]),
    "zero norm epsilon": (_override("model.norm_eps=0"), ["model.norm_eps=0.0", "> 0"]),
    # Natural slips.
    "sources as plain strings": (
        _override("data.sources=[{corpus}]"),
        ["data.sources[0] must be a mapping", "- path: "],
    ),
    "sources as one string": (_override("data.sources={corpus}"), ["data.sources must be a list"]),
    "override without a value": (_override("train.steps"), ["override 'train.steps'", "key=value"]),
    "override into a value": (_override("name.first=x"), ["override 'name.first=x'", "name in", "not a section"]),
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
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/zero1.json", [f"run_dir={_write(t / 'notes.txt', 'x')}"]),
        ["notes.txt is a file", "set run_dir="],
    ),
    "run_dir under a file": (
        lambda t, c: (
            small_recipe(t, c),
            ROOT / "ds_configs/zero1.json",
            [f"run_dir={_write(t / 'notes.txt', 'x')}/run"],
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
            [f"run_dir={_folder_with(t / 'mine', 'thesis.tex')}"],
        ),
        ["holds files that no run wrote (thesis.tex)"],
    ),
    "init_from a missing folder": (
        lambda t, c: (small_recipe(t, c, init_from=str(t / "no-model")), ROOT / "ds_configs/zero1.json", []),
        ["init_from", "no-model/config.json: no such file"],
    ),
    "init_from a folder that is not a model": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(_folder_with(t / "empty", "README"))),
            ROOT / "ds_configs/zero1.json",
            [],
        ),
        ["init_from", "config.json: no such file"],
    ),
    "init_from a dstrain run without a checkpoint": (
        lambda t, c: (small_recipe(t, c, init_from=_existing_run(t, c)), ROOT / "ds_configs/zero1.json", []),
        ["init_from", "checkpoints: no complete checkpoint"],
    ),
    "init_from a model without weights": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(_hf_config(t, weights=False))),
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
    "experts not divisible by the expert-parallel size": (
        lambda t, c: (
            small_recipe(t, c, model={"moe": {"num_experts": 3, "top_k": 2}}),
            ROOT / "ds_configs/ep2_zero1.json",
            [],
        ),
        ["expert_parallel.autoep_size=2 does not divide model.moe.num_experts=3", "pick a divisor"],
    ),
    "expert parallelism with pipeline stages": (
        lambda t, c: (
            small_recipe(t, c, model={"moe": {"num_experts": 4}}),
            ds_config(t, "pp2_zero1", expert_parallel={"enabled": True, "autoep_size": 2}),
            [],
        ),
        ["model.moe with pipeline.stages > 1 is not supported", "ep2_zero1.json"],
    ),
    "MoE under ZeRO-3": (
        lambda t, c: (small_recipe(t, c, model={"moe": {"num_experts": 4}}), ROOT / "ds_configs/zero3.json", []),
        ["ZeRO-3 cannot train", "model.moe", "ZeRO stage 0-2 only", "DeepSpeed/issues/2870", "offload_optimizer"],
    ),
    "expert parallelism without experts": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/ep2_zero1.json", []),
        ["expert_parallel needs model.moe"],
    ),
    "init_from another architecture": (
        lambda t, c: (
            small_recipe(t, c, init_from=str(_hf_config(t, weights=True))),
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
                    _folder_with(
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


@pytest.fixture(autouse=True)
def no_fp16(monkeypatch):
    """Every case is about this CPU's answer; a GPU node with fp16 must give the same one."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, corpus, capsys, monkeypatch):
    from dstrain.train.run import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a 2-rank launcher; nothing reaches the process group
    build, fragments = CASES[case]
    recipe, config, extra = build(tmp_path, corpus)
    if not any(str(a).startswith("run_dir=") for a in extra):
        extra = [*extra, f"run_dir={tmp_path / 'run'}"]
    before = snapshot(tmp_path)
    assert main(["--recipe", str(recipe), "--deepspeed_config", str(config), *extra]) == 2
    assert_one_line(capsys.readouterr().err, "dstrain: error: ", fragments)
    assert snapshot(tmp_path) == before  # nothing written, nothing touched


def test_a_full_disk_is_reported_before_training(monkeypatch, tmp_path):
    import shutil

    from dstrain.config import load_recipe
    from dstrain.errors import DstrainError
    from dstrain.train.run import check_disk

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

    from dstrain.config import load_recipe, to_dict

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
            str(_write(t / "f", "x")),
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
            f"{_write(t / 'f', 'x')}/d",
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
        ["was prepared with another tokenizer than the run", "--tokenizer"],
    ),
    "eval --tasks of malformed YAML": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--tasks", str(_write(t / "tasks.yaml", "- {name: piqa,\n"))],
        ["tasks.yaml: malformed YAML at line"],
    ),
    "eval --tasks naming a file that is not text": (
        lambda t, c, o: ["eval", str(_run_folder(t, c)), "--tasks", str(_tasks_of_a_binary_file(t))],
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
