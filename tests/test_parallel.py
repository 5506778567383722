"""Model parallelism chosen by the ds_config, on CPU ranks (gloo, fp32): pipeline stages and AutoTP tensor
parallelism give the plain model's losses, resume exactly, and convert to and from the plain state dict."""

import inspect
import json

import numpy as np
import pytest
import torch
import yaml

import train_helpers
from ranks import run_ranks
from train_helpers import (
    QWEN3_MODEL,
    ROOT,
    ds_config,
    read_metrics,
    small_recipe,
    train_argv,
    train_losses,
)

pytestmark = pytest.mark.distributed

# The same bound as tests/test_train.py: model parallelism reorders the same fp32 sums (a split matmul and
# an all-reduce, p2p hand-offs) and every pre-clip norm is taken in fp64 (measured: pipeline runs agree bit for
# bit, TP to 1e-7). A lost gradient, a skipped sample or a wrong init moves losses by 1e-2.
LOSS_RTOL = 1e-6
BF16_RTOL = 1e-3  # bf16 rounds the same sums to 8 bits of mantissa (measured: 5e-5 by step 10)
LOGITS_ATOL = 1e-5  # one forward of a consolidated TP model: row-parallel partial sums added in another order

CONFIGS = {
    name: ROOT / "ds_configs" / f"{name}.json"
    for name in ["zero1", "pp2_zero1", "tp2_zero1", "zero1_bf16", "pp2_zero1_bf16", "tp2_zero1_bf16"]
}
POSITIONS = [*range(12), *range(20)]  # two documents in one sample: doc masking passes (hidden, position_ids)


# --- rank targets (module level, so spawned ranks can import them) -----------------------------------


def run_all(calls: list) -> list:
    """Rank target: call each (function name, args) of this module or train_helpers in turn, in one process group."""
    return [(globals().get(name) or getattr(train_helpers, name))(*args) for name, args in calls]


def pipeline_grid_left_behind() -> str:
    """Just after a pipeline run: what DeepSpeed left in its module-global groups.mpu."""
    from deepspeed.utils import groups

    return type(groups.mpu).__name__


def engine_for(run_dir, config_file):
    """A fresh engine for a finished run's recipe under ``config_file``, its newest checkpoint's weights loaded."""
    from dstrain.config import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine import build_engine, build_model

    recipe = load_recipe(f"{run_dir}/recipe.yaml")
    strategy = resolve(
        recipe, "recipe.yaml", load_ds_config(config_file), config_file, torch.distributed.get_world_size()
    )
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    engine.load_checkpoint(f"{run_dir}/checkpoints", load_module_only=True)
    return engine


def sample_inputs(vocab_size: int):
    tokens = torch.randint(0, vocab_size, (4, len(POSITIONS) + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], torch.tensor([POSITIONS] * 4), tokens[:, 1:]


def pipeline_round_trip_logits(run_dir, config_file):
    """Logits of the pipeline run's checkpoint loaded by DeepSpeed, then of the same checkpoint converted to a
    plain state dict and loaded back into the stages (last stage; None elsewhere)."""
    from dstrain.checkpoint.consolidate import load_into_pipeline, read_checkpoint

    engine = engine_for(run_dir, config_file)
    config, state = read_checkpoint(run_dir)
    input_ids, position_ids, labels = sample_inputs(config.vocab_size)

    def logits():
        _, out = engine.eval_batch(
            iter([((input_ids, position_ids), labels)]),
            num_micro_batches=1,
            return_logits=True,
            reduce_output=None,
            bcast_loss=False,
        )
        return out

    native = logits()
    load_into_pipeline(engine.module, state, config)
    return tuple(None if out is None else out.numpy() for out in (native, logits()))


def tensor_parallel_logits(run_dir, config_file):
    """Logits of the TP run's checkpoint, loaded into a TP engine."""
    engine = engine_for(run_dir, config_file)
    input_ids, position_ids, _ = sample_inputs(engine.module.config.vocab_size)
    engine.eval()
    with torch.no_grad():
        return engine(input_ids, position_ids).numpy()


def pipeline_eval_with_monitor(folder) -> str:
    """What PipelineEngine.eval_batch(reduce_output=None) does when the ds_config enables a monitor."""
    import deepspeed

    from dstrain.model.config import GPTConfig
    from dstrain.model.pipe import build_pipeline

    config = GPTConfig(flavour="llama", vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    ds = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "csv_monitor": {"enabled": True, "output_path": str(folder), "job_name": "monitor"},
    }
    model = build_pipeline(config, seed=0, stages=1)  # two one-stage pipelines: no collective to hang on
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    tokens = torch.randint(0, 64, (1, 9))
    try:
        engine.eval_batch(
            iter([(tokens[:, :-1], tokens[:, 1:])]), num_micro_batches=1, reduce_output=None, bcast_loss=False
        )
    except Exception as e:  # noqa: BLE001  (the defect's type is what we report)
        return type(e).__name__
    return "ok"


# --- the runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Every 2-rank run of this file in one process group, then the 4-rank ones in another: 17 runs of 10 steps,
    about 45 s on 2 idle cores (about 2 minutes while other work shares them)."""
    tmp = tmp_path_factory.mktemp("parallel")
    recipe = small_recipe(tmp, corpus, model={"doc_masking": True}, train={"eval_samples": 30})
    gpt2 = small_recipe(
        tmp, corpus, name="gpt2", model={"flavour": "gpt2", "n_kv_head": None}, train={"eval_samples": 30}
    )
    qwen3 = small_recipe(
        tmp, corpus, name="qwen3", model={"doc_masking": True, **QWEN3_MODEL}, train={"eval_samples": 30}
    )
    deep = small_recipe(tmp, corpus, name="deep", model={"doc_masking": True, "n_layer": 4}, train={"eval_samples": 30})
    pp4 = ds_config(tmp, "pp2_zero1", pipeline={"stages": 4})
    gpt2_pipe = ds_config(
        tmp, "pp2_zero1", pipeline={"stages": 2, "partition_method": "type:Block", "activation_checkpoint_interval": 1}
    )
    gpt2_pipe_zero0 = ds_config(
        tmp, "pp2_zero1", pipeline={"stages": 2, "partition_method": "type:Block"}, zero_optimization={"stage": 0}
    )
    chunked = {base: ds_config(tmp, base, tiling={"loss": 4}) for base in ("pp2_zero1", "tp2_zero1", "zero2", "zero3")}
    gpt2_pipe_chunked = ds_config(
        tmp, "pp2_zero1", pipeline={"stages": 2, "partition_method": "type:Block"}, tiling={"loss": 4}
    )
    names = [
        "pp2",
        "tp2",
        "zero1",
        "gpt2_zero1",
        "gpt2_pp2",
        "gpt2_tp2",
        "gpt2_pp2_zero0",
        "pp2_resumed",
        "tp2_resumed",
        "deep_zero1",
        "zero1_bf16",
        "pp2_zero1_bf16",
        "tp2_zero1_bf16",
        "qwen3_zero1",
        "qwen3_pp2",
        "qwen3_tp2",
        "pp2_chunked",
        "tp2_chunked",
        "gpt2_pp2_chunked",
        "gpt2_zero2_chunked",
        "gpt2_zero3_chunked",
    ]
    d = {name: tmp / name for name in names}
    calls = [
        ("train", [train_argv(recipe, CONFIGS["pp2_zero1"], d["pp2"])]),
        ("pipeline_grid_left_behind", []),
        ("pipeline_eval_with_monitor", [tmp / "monitor"]),
        ("train", [train_argv(recipe, CONFIGS["tp2_zero1"], d["tp2"])]),
        ("train", [train_argv(recipe, CONFIGS["zero1"], d["zero1"])]),  # after both: build_engine clears their grids
        ("train", [train_argv(gpt2, CONFIGS["zero1"], d["gpt2_zero1"])]),
        ("train", [train_argv(gpt2, gpt2_pipe, d["gpt2_pp2"])]),
        ("train", [train_argv(gpt2, CONFIGS["tp2_zero1"], d["gpt2_tp2"])]),
        ("train", [train_argv(gpt2, gpt2_pipe_zero0, d["gpt2_pp2_zero0"])]),
        ("train", [train_argv(deep, CONFIGS["zero1"], d["deep_zero1"])]),
        (
            "train_and_signal_at",
            [train_argv(recipe, CONFIGS["pp2_zero1"], d["pp2_resumed"], "train.checkpoint_interval=3"), 4],
        ),
        ("train", [train_argv(recipe, CONFIGS["pp2_zero1"], d["pp2_resumed"])]),
        (
            "train_and_signal_at",
            [train_argv(recipe, CONFIGS["tp2_zero1"], d["tp2_resumed"], "train.checkpoint_interval=3"), 4],
        ),
        ("train", [train_argv(recipe, CONFIGS["tp2_zero1"], d["tp2_resumed"])]),
        *(
            ("train", [train_argv(recipe, CONFIGS[name], d[name])])
            for name in ("zero1_bf16", "pp2_zero1_bf16", "tp2_zero1_bf16")
        ),
        ("train", [train_argv(qwen3, CONFIGS["zero1"], d["qwen3_zero1"])]),
        ("train", [train_argv(qwen3, CONFIGS["pp2_zero1"], d["qwen3_pp2"])]),
        ("train", [train_argv(qwen3, CONFIGS["tp2_zero1"], d["qwen3_tp2"])]),
        # the chunked loss: on the last stage, beside AutoTP, and with the head tied (ZeRO-2 and 3 reduce its
        # gradient once, after the embedding's share: dstrain.train.tiling)
        ("train", [train_argv(recipe, chunked["pp2_zero1"], d["pp2_chunked"])]),
        ("train", [train_argv(recipe, chunked["tp2_zero1"], d["tp2_chunked"])]),
        ("train", [train_argv(gpt2, gpt2_pipe_chunked, d["gpt2_pp2_chunked"])]),
        ("train", [train_argv(gpt2, chunked["zero2"], d["gpt2_zero2_chunked"])]),
        ("train", [train_argv(gpt2, chunked["zero3"], d["gpt2_zero3_chunked"])]),
        ("pipeline_round_trip_logits", [d["pp2"], CONFIGS["pp2_zero1"]]),
        ("tensor_parallel_logits", [d["tp2"], CONFIGS["tp2_zero1"]]),
        ("tensor_parallel_logits", [d["gpt2_tp2"], CONFIGS["tp2_zero1"]]),
    ]
    results = run_ranks(2, run_all, calls)
    assert [[code for (name, _), code in zip(calls, rank) if name.startswith("train")] for rank in results] == [
        [0] * 23
    ] * 2
    d["results"] = {
        f"{name}:{args[0].name if args else ''}": [rank[i] for rank in results]
        for i, (name, args) in enumerate(calls)
        if not name.startswith("train")
    }
    d.update({name: tmp / name for name in ["pp2_x_dp2", "tp2_x_dp2", "deep_pp4"]})
    four = [
        ("train", [train_argv(recipe, CONFIGS["pp2_zero1"], d["pp2_x_dp2"])]),
        ("train", [train_argv(recipe, CONFIGS["tp2_zero1"], d["tp2_x_dp2"])]),
        ("train", [train_argv(deep, pp4, d["deep_pp4"])]),
    ]  # two middle stages, which never touch the data
    assert run_ranks(4, run_all, four) == [[0, 0, 0]] * 4
    return d


# --- same math under every layout ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "run, reference",
    [
        ("pp2", "zero1"),
        ("tp2", "zero1"),
        ("pp2_x_dp2", "zero1"),
        ("tp2_x_dp2", "zero1"),
        ("deep_pp4", "deep_zero1"),
        ("qwen3_pp2", "qwen3_zero1"),
        ("qwen3_tp2", "qwen3_zero1"),
        ("pp2_chunked", "zero1"),
        ("tp2_chunked", "zero1"),
        ("gpt2_pp2_chunked", "gpt2_zero1"),
        ("gpt2_zero2_chunked", "gpt2_zero1"),
        ("gpt2_zero3_chunked", "gpt2_zero1"),
    ],
)
def test_model_parallel_runs_give_the_data_parallel_losses(runs, run, reference):
    expected, losses = train_losses(runs[reference]), train_losses(runs[run])
    assert len(losses) == len(expected) == 10
    np.testing.assert_allclose(losses, expected, rtol=LOSS_RTOL)
    assert expected[-1] < expected[0] - 0.3  # and the model learns (warmup from lr 0: one update fewer learns)
    evals = [[r["loss"] for r in read_metrics(runs[name]) if r.get("split") == "valid"] for name in (run, reference)]
    np.testing.assert_allclose(evals[0], evals[1], rtol=LOSS_RTOL)  # 30 eval samples: a short last micro-batch


@pytest.mark.parametrize("run", ["pp2_zero1_bf16", "tp2_zero1_bf16"])
def test_bf16_configs_give_the_bf16_data_parallel_losses(runs, run):
    np.testing.assert_allclose(train_losses(runs[run]), train_losses(runs["zero1_bf16"]), rtol=BF16_RTOL)
    np.testing.assert_allclose(train_losses(runs["zero1_bf16"]), train_losses(runs["zero1"]), rtol=BF16_RTOL)


def test_pipeline_starts_from_the_plain_models_weights(runs):
    """Each stage builds only its layers, yet the first loss (and gradient norm) equals the plain model's."""
    plain, pipe = read_metrics(runs["zero1"])[0], read_metrics(runs["pp2"])[0]
    assert abs(pipe["loss"] - plain["loss"]) < 1e-6 and abs(pipe["grad_norm"] - plain["grad_norm"]) < 1e-6


@pytest.mark.parametrize(
    "run, reference",
    [
        ("pp2", "zero1"),
        ("tp2", "zero1"),
        ("pp2_x_dp2", "zero1"),
        ("tp2_x_dp2", "zero1"),
        ("deep_pp4", "deep_zero1"),
        ("gpt2_pp2", "gpt2_zero1"),
        ("gpt2_tp2", "gpt2_zero1"),
        ("gpt2_pp2_zero0", "gpt2_zero1"),
        ("qwen3_pp2", "qwen3_zero1"),
        ("qwen3_tp2", "qwen3_zero1"),
        ("pp2_chunked", "zero1"),
        ("tp2_chunked", "zero1"),
        ("gpt2_pp2_chunked", "gpt2_zero1"),
        ("gpt2_zero2_chunked", "gpt2_zero1"),
        ("gpt2_zero3_chunked", "gpt2_zero1"),
    ],
)
def test_grad_norm_is_the_global_norm_under_every_layout(runs, run, reference):
    """One norm over the whole model: stages summed, TP replicas and the tied head counted once. Under pipeline
    ZeRO-0 dstrain computes (and clips by) it: DeepSpeed would use the first stage's norm (tests/test_grad_norm.py)."""
    expected, norms = (
        [r["grad_norm"] for r in read_metrics(runs[name]) if "split" not in r] for name in (reference, run)
    )
    assert norms[0] == pytest.approx(expected[0], rel=1e-7)  # the same weights: only the reduction order differs
    np.testing.assert_allclose(norms, expected, rtol=LOSS_RTOL)


@pytest.mark.parametrize("run", ["gpt2_pp2", "gpt2_tp2", "gpt2_pp2_zero0"])
def test_gpt2_flavour(runs, run):
    """gpt2: the head tied to the embedding across stages (TiedLayerSpec), blocks recomputed in backward
    (activation_checkpoint_interval 1, partition_method type:Block); biases split with their TP columns."""
    np.testing.assert_allclose(train_losses(runs[run]), train_losses(runs["gpt2_zero1"]), rtol=LOSS_RTOL)


def test_run_records_the_model_parallel_strategy(runs):
    """Global batch 8 of micro-batches of 4; DeepSpeed counts the data-parallel world for pipelines, every rank for
    TP."""
    for run, (accumulation, train_batch_size) in {
        "pp2": (2, 8),
        "tp2": (2, 16),
        "pp2_x_dp2": (1, 8),
        "tp2_x_dp2": (1, 16),
    }.items():
        ds = json.loads((runs[run] / "ds_config.json").read_text())
        assert (ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (accumulation, train_batch_size), run
    assert yaml.safe_load((runs["pp2"] / "recipe.yaml").read_text())["train"]["global_batch"] == 8
    assert [r["consumed_samples"] for r in read_metrics(runs["pp2"]) if "split" not in r] == list(range(8, 88, 8))


# --- exact resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_signal_checkpoints_and_resume_continues_exactly(runs, layout):
    """SIGUSR1 after step 4 -> checkpoint; the resumed run's steps 5..10 are the uninterrupted run's, bit for bit."""
    run = runs[f"{layout}_resumed"]
    losses = train_losses(run)
    assert len(losses) == 10 and losses == train_losses(runs[layout])
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["global_step10", "global_step4"]


# --- checkpoints <-> the plain state dict -------------------------------------------------------------


def plain_logits(run_dir):
    from dstrain.checkpoint.consolidate import read_checkpoint
    from dstrain.model.gpt import GPT

    config, state = read_checkpoint(run_dir)
    model = GPT(config)
    model.load_state_dict(state)  # strict: every plain name, whole shapes
    input_ids, position_ids, _ = sample_inputs(config.vocab_size)
    with torch.no_grad():
        return model(input_ids, position_ids).numpy()


def test_pipeline_checkpoint_round_trips_through_the_plain_state_dict(runs):
    first, (native, reloaded) = runs["results"]["pipeline_round_trip_logits:pp2"]  # rank 1 holds the last stage
    assert first == (None, None)
    np.testing.assert_array_equal(native, reloaded)  # the same weights in the same layers: identical, not close
    np.testing.assert_allclose(plain_logits(runs["pp2"]), native, rtol=0, atol=1e-6)


def test_pipeline_layers_and_plain_names_convert_both_ways(runs):
    from dstrain.checkpoint.consolidate import pipeline_to_plain, plain_to_pipeline, read_checkpoint, tag_folder

    tag = tag_folder(runs["gpt2_pp2"])
    config, state = read_checkpoint(tag)
    layers = {int(p.name[6:8]): torch.load(p, weights_only=True) for p in tag.glob("layer_*-model_states.pt")}
    assert sorted(layers) == list(range(config.n_layer + 2))  # the tied head (layer n+2) has no file of its own
    back = plain_to_pipeline(state, config)
    assert all(torch.equal(back[i][k], v) for i in layers for k, v in layers[i].items())
    assert {i: set(back[i]) for i in layers} == {i: set(layers[i]) for i in layers}
    assert (
        pipeline_to_plain(back, config).keys() == state.keys() and state["lm_head.weight"] is state["embed.tok.weight"]
    )


@pytest.mark.parametrize("run", ["tp2", "gpt2_tp2"])
def test_tensor_parallel_checkpoint_consolidates_to_the_plain_model(runs, run):
    """llama: grouped k/v heads split over the ranks; gpt2: column biases split, row biases replicated."""
    tp_logits = runs["results"][f"tensor_parallel_logits:{run}"]
    np.testing.assert_array_equal(tp_logits[0], tp_logits[1])  # both ranks of the TP group agree
    np.testing.assert_allclose(plain_logits(runs[run]), tp_logits[0], rtol=0, atol=LOGITS_ATOL)


# --- DeepSpeed behaviour worked around (these fail when an upgrade changes it) --------------------------


@pytest.mark.deepspeed_defect(
    "deepspeed.utils.groups.mpu outlives its engine (train/engine.py::build_engine resets it)"
)
def test_deepspeed_leaks_the_pipeline_grid(runs):
    """DeepSpeed 0.19.8 keeps a finished pipeline engine's grid in deepspeed.utils.groups.mpu; the next engine
    built without one reads its data-parallel group from it. engine.build_engine clears it (the zero1 run after
    the pipeline and TP runs shows it works). If this fails, the leak is fixed: drop the reset."""
    assert runs["results"]["pipeline_grid_left_behind:"] == ["PipelineParallelGrid"] * 2


@pytest.mark.deepspeed_defect(
    "PipelineEngine.eval_batch(reduce_output=None) breaks the monitor (train/engine.py::monitor_paused)"
)
def test_deepspeed_pipeline_eval_monitor_defect(runs):
    """PipelineEngine.eval_batch(reduce_output=None) feeds its monitor/broadcast a list when a monitor is on;
    engine.monitor_paused works around it. If this fails, drop the workaround."""
    assert runs["results"]["pipeline_eval_with_monitor:monitor"] == ["AttributeError"] * 2


@pytest.mark.deepspeed_defect("AutoTP replaces the pipeline grid (strategy refuses TP with PP)")
def test_deepspeed_autotp_replaces_the_pipeline_grid():
    """Why strategy.resolve refuses tensor_parallel with pipeline stages: AutoTP swaps the engine's mpu (for a
    pipeline engine, its grid) for deepspeed.utils.groups and builds a data x tensor mesh that ignores the stages;
    a 4-rank TP 2 x PP 2 run then broadcasts weights between stages and dies. If this fails, re-probe TP x PP."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    assert "self.mpu = groups" in inspect.getsource(DeepSpeedEngine._configure_tensor_parallel_states)
    assert "dist.get_world_size() // tensor_model_parallel_size" in inspect.getsource(groups._init_tp_mesh_device)


# --- refusals, before any process starts ----------------------------------------------------------------

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
}


def resolve_with(tmp_path, base: str, world: int, **changes):
    from dstrain.config import load_recipe
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
    assert (pp.pp_stages, pp.tp_size, pp.dp_size, pp.grad_accum, pp.ds_config["train_batch_size"]) == (2, 1, 2, 1, 8)
    tp = resolve_with(tmp_path, "tp2_zero1", 4)
    assert (tp.pp_stages, tp.tp_size, tp.dp_size, tp.grad_accum, tp.ds_config["train_batch_size"]) == (1, 2, 2, 1, 16)


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
