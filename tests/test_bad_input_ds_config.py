"""The catalogue of bad ds_configs (DeepSpeed's schema, and what dstrain accepts of it with the recipe): each a single
line on stderr naming the key and the fix, exit status 2, before DeepSpeed sees it (tests/bad_input.py)."""

import pytest

from bad_input import (
    edit_recipe,
    finished_run,
    no_fp16,  # noqa: F401  (a fixture: pytestmark)
    refuses_to_train,
    write,
    write_bytes,
)
from train_helpers import ROOT, ds_config, small_recipe

pytestmark = pytest.mark.usefixtures("no_fp16")  # each case is this CPU's answer, on a GPU node too

# name -> (build(tmp_path, corpus) -> (recipe, ds_config, extra argv), fragments the one line must contain)
CASES = {
    "malformed JSON": (
        lambda t, c: (small_recipe(t, c), write(t / "d.json", '{"zero_optimization": {"stage": 1}'), []),
        ["d.json: malformed JSON at line 1"],
    ),
    "ds_config not text": (
        lambda t, c: (small_recipe(t, c), write_bytes(t / "d.json", b"\x80\xff\x00"), []),
        ["d.json: not a text file"],
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
    "sequence parallelism not dividing the query heads": (  # beyond the key/value heads is fine: they are repeated
        lambda t, c: (small_recipe(t, c, model={"n_head": 1, "n_kv_head": 1}), ROOT / "ds_configs/sp2_zero1.json", []),
        ["sequence_parallel_size=2 does not divide the 1 query heads", "model.n_head"],
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
    "host checkpointing without activation checkpointing": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(
                t,
                "pp2_zero1",
                pipeline={"stages": 2, "activation_checkpoint_interval": 0},
                activation_checkpointing={"cpu_checkpointing": True},
            ),
            [],
        ),
        [
            "activation_checkpointing.cpu_checkpointing",
            "activation_checkpoint_interval=0 turns activation checkpointing",
        ],
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
        lambda t, c: (small_recipe(t, c), write(t / "d.json", "[1, 2]"), []),
        ["d.json: a ds_config is a JSON object"],
    ),
    "ds_config that is a folder": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs", []),
        ["ds_configs: cannot read the ds_config (Is a directory)"],
    ),
    "missing ds_config": (
        lambda t, c: (small_recipe(t, c), t / "nowhere.json", []),
        ["nowhere.json: no such ds_config file"],
    ),
    "finished run extended under a ds_config DeepSpeed rejects": (
        lambda t, c: (
            small_recipe(t, c),
            ds_config(t, "zero2", zero_optimization={"stage": 2, "overlap_com": True}),
            [f"run_dir={finished_run(t, c)}", "train.steps=20"],
        ),
        ['"zero_optimization.overlap_com"'],
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
    "pipeline stages with a preference recipe": (
        lambda t, c: (small_recipe(t, c, preference={"loss": "simpo"}), ROOT / "ds_configs/pp2_zero1.json", []),
        ["pp2_zero1.json: pipeline parallelism does not run a recipe's preference: section", "sequence-parallel"],
    ),
    "expert parallelism without experts": (
        lambda t, c: (small_recipe(t, c), ROOT / "ds_configs/ep2_zero1.json", []),
        ["expert_parallel needs model.moe"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, corpus, capsys, monkeypatch):
    refuses_to_train(CASES[case], tmp_path, corpus, capsys, monkeypatch)
