"""Model-parallel layouts a ds_config asks for, resolved in one process: the shipped ones resolve, and what dstrain
cannot run is refused in one line before any process starts (the runs themselves: tests/test_parallel.py)."""

import json

import pytest
import yaml

from train_helpers import ROOT

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
}


def resolve_with(tmp_path, base: str, world: int, **changes):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(config))
    return resolve(load_recipe(recipe), recipe, load_ds_config(path), path, world)


def test_shipped_parallel_configs_resolve(tmp_path):
    pp = resolve_with(tmp_path, "pp2_zero1", 4)
    assert (pp.pp_stages, pp.tp_size, pp.dp_size, pp.grad_accum, pp.deepspeed_config["train_batch_size"]) == (
        2,
        1,
        2,
        1,
        8,
    )
    tp = resolve_with(tmp_path, "tp2_zero1", 4)
    assert (tp.pp_stages, tp.tp_size, tp.dp_size, tp.grad_accum, tp.deepspeed_config["train_batch_size"]) == (
        1,
        2,
        2,
        1,
        16,
    )


@pytest.mark.parametrize(
    "base, world, changes, fragments",
    [
        ("tp2_zero1", 4, {"pipeline": {"stages": 2}}, ["tensor_parallel with pipeline.stages > 1", "tp2_zero1.json"]),
        (
            "tp2_zero1",
            4,
            {"tensor_parallel": {"autotp_size": 4}},
            ["autotp_size=4 does not divide the 2 key/value heads"],
        ),
        (
            "tp2_zero1",
            2,
            {
                "tensor_parallel": {
                    "partition_config": {
                        "layer_specs": [{"patterns": [r".*_proj\.weight$"], "partition_type": "column"}]
                    }
                }
            },
            ["must split self_attn.o_proj row-wise (it says column)", "tp2_zero1.json"],
        ),
        ("tp2_zero1", 2, {"tensor_parallel": {"partition_config": None}}, ["must split self_attn.q_proj column-wise"]),
        (
            "pp2_zero1",
            2,
            {"pipeline": {"partition_method": "profile"}},
            ["pipeline.partition_method='profile'", "type:Block"],
        ),
        ("pp2_zero1", 2, {"pipeline": {"activation_checkpoint_interval": -1}}, ["activation_checkpoint_interval=-1"]),
        ("pp2_zero1", 2, {"zero_optimization": {"stage": 2}}, ["ZeRO stage 0 or 1, not 2"]),
        ("pp2_zero1", 2, {"pipeline": {"stages": 4}}, ["not divisible by tensor-parallel 1 x pipeline 4"]),
        ("pp2_zero1", 3, {}, ["world size 3 is not divisible"]),
    ],
)
def test_refusals_are_one_line(tmp_path, base, world, changes, fragments):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError) as e:
        resolve_with(tmp_path, base, world, **changes)
    assert "\n" not in str(e.value) and "d.json" in str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_more_stages_than_blocks_is_refused(tmp_path):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError, match="pipeline.stages=4 exceeds the model's 2 blocks"):
        resolve_with(tmp_path, "pp2_zero1", 4, pipeline={"stages": 4})
