"""Recipes and ds_configs: typed parsing, "auto" resolution, batch arithmetic, and the refusals."""

import json
from pathlib import Path

import pytest
import yaml

from dstrain.errors import DstrainError
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

ROOT = Path(__file__).resolve().parents[1]

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
    "optim": {"lr": 1e-3, "grad_clip": 1.0},
}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
    return path


def strategy_for(tmp_path, ds: dict, world: int = 2, recipe: dict = RECIPE):
    r = write(tmp_path, "r.yaml", recipe)
    d = write(tmp_path, "d.json", ds)
    return resolve(load_recipe(r), r, load_ds_config(d), d, world)


def one_line_error(fn, *fragments):
    with pytest.raises(DstrainError) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_auto_fills_from_recipe_and_derives_accumulation(tmp_path):
    s = strategy_for(
        tmp_path,
        json.loads((ROOT / "ds_configs/zero2.json").read_text()),
        world=2,
        recipe={**RECIPE, "train": {"global_batch": 16, "steps": 4}},
    )
    c = s.deepspeed_config
    assert (s.micro_batch, s.dp_size, s.grad_accum) == (4, 2, 2)
    assert c["train_batch_size"] == 16 and c["gradient_accumulation_steps"] == 2
    assert c["gradient_clipping"] == 1.0
    assert c["optimizer"]["params"]["lr"] == 1e-3 and c["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert "auto" not in json.dumps(c)


def fake_fp16(monkeypatch, supported: bool) -> None:
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: supported)


SHIPPED = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json"))


def model_parallel_size(ds: dict) -> int:
    """Ranks of one model replica: pipeline stages x tensor-parallel x sequence-parallel."""
    tp = ds.get("tensor_parallel", {}).get("autotp_size", 1)
    return ds.get("pipeline", {}).get("stages", 1) * tp * ds.get("sequence_parallel_size", 1)


def expert_parallel_size(ds: dict) -> int:
    return ds.get("expert_parallel", {}).get("autoep_size", 1)


@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_ds_config_resolves_or_refuses_clearly(tmp_path, config, monkeypatch):
    fake_fp16(monkeypatch, False)  # a device without fp16, whatever this machine has
    ds = json.loads((ROOT / "ds_configs" / config).read_text())
    if ds.get("fp16", {}).get("enabled"):  # the refusal names a bf16 config
        one_line_error(lambda: strategy_for(tmp_path, ds), "fp16 is not supported", "bf16")
        return
    recipe = {**RECIPE, "model": {**RECIPE["model"], "n_layer": 4, "n_head": 8, "d_model": 64}}
    recipe["train"] = {"global_batch": 32, "steps": 4}
    if "expert_parallel" in ds:  # expert parallelism needs a mixture of experts, and as many data-parallel ranks
        recipe["model"]["moe"] = {"num_experts": max(4, expert_parallel_size(ds))}
    stages = model_parallel_size(ds)
    s = strategy_for(tmp_path, ds, world=max(2, expert_parallel_size(ds)) * stages, recipe=recipe)
    assert s.micro_batch * s.grad_accum * s.dp_size == 32


def test_every_shipped_ds_config_passes_deepspeeds_own_parser(tmp_path, monkeypatch):
    """resolve() ends in ds_schema.validate_ds_config: DeepSpeedConfig accepts each and reads every key of each."""
    from dstrain.strategy.ds_schema import validate_ds_config

    fake_fp16(monkeypatch, True)
    recipe = {**RECIPE, "model": {**RECIPE["model"], "n_layer": 4, "n_head": 8, "d_model": 64}}
    recipe["train"] = {"global_batch": 32, "steps": 4}
    for config in SHIPPED:
        ds = json.loads((ROOT / "ds_configs" / config).read_text())
        stages, ep = model_parallel_size(ds), expert_parallel_size(ds)
        model = {**recipe, "model": {**recipe["model"], "moe": {"num_experts": max(4, ep)}}}
        model = model if "expert_parallel" in ds else recipe
        strategy = strategy_for(tmp_path, ds, world=max(2, ep) * stages, recipe=model)
        validate_ds_config(strategy.resolved_ds_config)  # raises the first key DeepSpeed rejects


def test_deepspeed_sections_dstrain_does_not_read_are_accepted(tmp_path):
    ds = json.loads((ROOT / "ds_configs/zero2.json").read_text())
    ds.update(
        activation_checkpointing={
            "partition_activations": True,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        data_types={"grad_accum_dtype": "fp32"},
        communication_data_type="fp32",
        wall_clock_breakdown=True,
        tensorboard={"enabled": True, "output_path": "auto", "job_name": "auto"},
        seed="auto",
        aio={"block_size": 1048576, "intra_op_parallelism": 1},
    )
    s = strategy_for(tmp_path, ds)
    assert s.deepspeed_config["seed"] == 1234 and s.deepspeed_config["communication_data_type"] == "fp32"


@pytest.mark.parametrize(
    "change, fragments",
    [
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            ['"zero_optimization.overlap_com"', '"zero_optimization.overlap_comm"'],
        ),
        ({"zero_optimisation": {"stage": 1}}, ['unknown key "zero_optimisation"', '"zero_optimization"']),
        ({"aio": {"thread_count": 1}}, ['"aio.thread_count"', "remove it"]),
        ({"optimizer": {"type": "Adamw8bit", "params": {}}}, ['optimizer.type "Adamw8bit"']),
        (
            {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1.5}},
            ['"zero_optimization.stage3_max_live_parameters"'],
        ),
        ({"seed": 5}, ["pins seed=5", "sets seed=1234"]),
        ({"nebula": {"enabled": True}}, ["DeepSpeed rejects this ds_config", "Nebula checkpointing has been removed"]),
    ],
)
def test_ds_config_errors_name_the_file_and_key(tmp_path, change, fragments):
    ds = {**json.loads((ROOT / "ds_configs/zero1.json").read_text()), **change}
    one_line_error(lambda: strategy_for(tmp_path, ds), "d.json", *fragments)


def test_overrides_are_typed(tmp_path):
    r = write(tmp_path, "r.yaml", RECIPE)
    recipe = load_recipe(r, ["optim.lr=2e-4", "train.steps=7", "model.doc_masking=true", "optim.betas=[0.8, 0.9]"])
    assert recipe.optim.lr == 2e-4 and recipe.train.steps == 7 and recipe.model.doc_masking is True
    assert recipe.optim.betas == (0.8, 0.9)


def test_unknown_key_suggests_closest(tmp_path):
    bad = {**RECIPE, "train": {"global_batch": 8, "steps": 4, "eval_intervall": 3}}
    one_line_error(
        lambda: load_recipe(write(tmp_path, "r.yaml", bad)), "r.yaml", "train.eval_intervall", "train.eval_interval"
    )


def test_unknown_override_key(tmp_path):
    r = write(tmp_path, "r.yaml", RECIPE)
    one_line_error(lambda: load_recipe(r, ["optim.learning_rate=1"]), "optim.learning_rate")


def test_wrong_type_names_key(tmp_path):
    bad = {**RECIPE, "train": {"global_batch": "eight", "steps": 4}}
    one_line_error(lambda: load_recipe(write(tmp_path, "r.yaml", bad)), "train.global_batch must be int")


def test_model_check_names_file_and_key(tmp_path):
    bad = {**RECIPE, "model": {**RECIPE["model"], "n_head": 3}}
    one_line_error(lambda: load_recipe(write(tmp_path, "r.yaml", bad)), "r.yaml", "model.n_head")


def test_seq_len_above_model_positions(tmp_path):
    bad = {**RECIPE, "model": {**RECIPE["model"], "max_seq_len": 8}}
    one_line_error(lambda: load_recipe(write(tmp_path, "r.yaml", bad)), "data.seq_len=16", "model.max_seq_len=8")


def test_malformed_yaml_and_json(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("model: [unclosed\n")
    one_line_error(lambda: load_recipe(r), "r.yaml", "malformed YAML", "line")
    d = tmp_path / "d.json"
    d.write_text('{"train_batch_size": "auto",}')
    one_line_error(lambda: load_ds_config(d), "d.json", "malformed JSON", "line 1")


def test_indivisible_batch_lists_valid_micro_batches(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 1}}
    one_line_error(
        lambda: strategy_for(tmp_path, ds, world=2),
        "train_micro_batch_size_per_gpu=3",
        "valid micro-batch sizes for 2 ranks: 1, 2, 4",
    )


def test_pinned_value_contradicting_recipe_names_both_files(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5}
    one_line_error(
        lambda: strategy_for(tmp_path, ds), "d.json: pins gradient_clipping=0.5", "r.yaml sets optim.grad_clip=1.0"
    )
    ds = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 64}
    one_line_error(lambda: strategy_for(tmp_path, ds), "train_batch_size=64", "train.global_batch=8")


def test_equal_pin_is_accepted(tmp_path):
    s = strategy_for(
        tmp_path, {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "gradient_accumulation_steps": 2}
    )
    assert s.grad_accum == 2


def test_scheduler_section_refused(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLR"}}
    one_line_error(lambda: strategy_for(tmp_path, ds), "scheduler", "schedule.*")


def test_pipeline_with_zero2_refused_suggesting_zero1(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}}
    one_line_error(lambda: strategy_for(tmp_path, ds, world=2), "pipeline", "stage to 1")


def test_world_not_divisible_by_model_parallel(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}}
    one_line_error(lambda: strategy_for(tmp_path, ds, world=3), "world size 3", "multiple of 2")


def test_more_stages_than_blocks_refused(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 4}, "zero_optimization": {"stage": 1}}
    one_line_error(lambda: strategy_for(tmp_path, ds, world=4), "pipeline.stages=4", "2 blocks")


def test_fp16_with_zero0_refused_when_device_has_fp16(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    ds = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    one_line_error(lambda: strategy_for(tmp_path, ds), "ZeRO stage 0", "zero1_fp16.json")


def test_both_precisions_refused(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    one_line_error(lambda: strategy_for(tmp_path, ds), "one of fp16 and bf16")


def test_every_numeric_recipe_field_declares_its_range():
    """A new int or float field without a Range would let 0 or a negative through to the first step."""
    import typing

    from dstrain.config import (
        DataConfig,
        DataSource,
        OptimConfig,
        Recipe,
        ScheduleConfig,
        SpikeGuardConfig,
        TrainConfig,
        WatchdogConfig,
    )
    from dstrain.model.config import GPTConfig
    from dstrain.ranges import Range

    def numeric_without_range(hint) -> bool:
        if typing.get_origin(hint) is typing.Annotated:
            numeric = typing.get_args(hint)[0] in (int, float)  # a string's NonEmpty is no range
            return numeric and not any(isinstance(m, Range) for m in hint.__metadata__)
        if hint in (int, float):
            return True
        return any(numeric_without_range(a) for a in typing.get_args(hint) if a is not type(None))

    missing = [
        f"{cls.__name__}.{name}"
        for cls in (
            Recipe,
            DataSource,
            DataConfig,
            OptimConfig,
            ScheduleConfig,
            TrainConfig,
            SpikeGuardConfig,
            WatchdogConfig,
            GPTConfig,
        )
        for name, hint in typing.get_type_hints(cls, include_extras=True).items()
        if numeric_without_range(hint)
    ]
    assert not missing, missing


@pytest.mark.parametrize(
    "change, fragments",
    [
        ({"zero_optimization": {"stage": 0}}, ["ZeRO stage 0 sums gradients in bf16", "zero1_bf16.json"]),
        ({"data_types": None}, ["accumulated in bf16", '"grad_accum_dtype": "fp32"']),
        ({"communication_data_type": None}, ["reduced across ranks in bf16", '"communication_data_type": "fp32"']),
        ({"communication_data_type": "bf16"}, ["reduced across ranks in bf16"]),
    ],
)
def test_a_bf16_config_that_would_sum_gradients_in_bf16_is_refused(tmp_path, change, fragments):
    ds = json.loads((ROOT / "ds_configs/zero1_bf16.json").read_text())
    for key, value in change.items():
        ds.pop(key) if value is None else ds.update({key: value})
    one_line_error(lambda: strategy_for(tmp_path, ds), "d.json", *fragments)


@pytest.mark.launcher
def test_the_recipe_and_the_light_commands_load_no_torch():
    """A recipe, `dstrain --help` and the commands that need no model (`prepare`, `estimate`, `compare --help`)
    import neither torch nor DeepSpeed: a login node or an sbatch check answers in a fraction of a second."""
    import subprocess
    import sys

    probe = """if True:
        import sys
        from dstrain.recipe_file import load_recipe
        from dstrain.commands.cli import main
        load_recipe(sys.argv[1], ["model.vocab_size=512"])  # no prepared data needed
        for argv in (["--help"], ["prepare", "--help"], ["estimate", "--help"], ["compare", "--help"]):
            try:
                main(argv)
            except SystemExit:
                pass
        print(sorted(m for m in ("torch", "deepspeed", "transformers") if m in sys.modules))
    """
    done = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "recipes" / "tiny.yaml")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
