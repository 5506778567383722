"""Muon (optim.kind: muon): DeepSpeed's MuonWithAuxAdam against a plain PyTorch reference; the same losses and pre-clip
gradient norms under every layout dstrain accepts it in, with clipping on; exact resume; the refusals, and the
DeepSpeed behaviour behind them."""

import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from dstrain.run_dir import RunDir

from ranks import run_ranks
from train_helpers import (
    ROOT,
    ds_config,
    read_metrics,
    small_recipe,
    train_and_signal_at,
    train_argv,
    train_each,
    train_losses,
)


def _layout_rtol() -> float:
    """fp32, ZeRO-0: the layouts differ only in how the same gradients are summed (ranks, micro-batches), as for AdamW
    (tests/test_train.py; measured <= 2e-7 over 10 steps); Newton-Schulz in fp32 maps a 1e-7 change of its input to
    about as much of its output. Where DeepSpeed runs it in fp16 (its CPU accelerator reports fp16 on a CPU with
    AVX512-FP16 or AMX-FP16), each iteration rounds to fp16's unit of 4.9e-4: measured up to 1.3e-5 on the losses and
    1.2e-4 on the pre-clip norms over the 10 steps on such a CPU, so 5e-4 there (a constant factor on the update, e.g.
    a missing aspect-ratio scale, is off by percents)."""
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    return 1e-6 if ns_compute_dtype("gram") == torch.float32 else 5e-4


MUON_RTOL = _layout_rtol()
STEP1_NORM_RTOL = 1e-7
CLIP = 0.5  # below the small recipe's norms from step 1: every step is clipped


# --- Muon's update against a plain PyTorch reference --------------------------------------------------------


def reference_orthogonalise(update: torch.Tensor) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz (5 steps, coefficients 3.4445, -4.7750, 2.0315) in fp64 on the whole
    matrix, scaled by sqrt(max(1, rows / cols))."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if tall else x
    return x * math.sqrt(max(1.0, update.size(0) / update.size(1)))


@pytest.mark.parametrize("shape", [(32, 16), (16, 48), (24, 24)])
def test_muon_update_matches_a_plain_pytorch_reference(shape):
    """Three steps of DeepSpeed's MuonWithAuxAdam (the ZeRO-0 path: the whole matrix) against momentum, Nesterov,
    Newton-Schulz and decoupled weight decay written out in fp64; eager (the training tests run it as trained).
    DeepSpeed's "gram" iteration runs in fp32 on a CPU (fp16 where the device has it): measured 2.6e-5 of the
    update. A missing aspect-ratio scale is 41% off, plain momentum instead of Nesterov about as much."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    if ns_compute_dtype("gram") != torch.float32:
        pytest.skip("the device runs Newton-Schulz in fp16: compare at fp16's precision on a GPU")
    lr, beta, decay = 0.02, 0.95, 0.1
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(*shape, generator=generator)
    param = torch.nn.Parameter(start.clone())
    group = {"params": [param], "use_muon": True, "lr": lr, "momentum": beta, "weight_decay": decay}
    optimizer = MuonWithAuxAdam([{**group, "ns_method": "gram"}])
    weight, momentum = start.double(), torch.zeros(shape, dtype=torch.float64)
    for _ in range(3):
        grad = torch.randn(*shape, generator=generator)
        param.grad = grad.clone()
        with torch.compiler.set_stance("force_eager"):  # DeepSpeed torch.compiles muon_update: 20 s on a CPU
            optimizer.step()
        momentum.lerp_(grad.double(), 1 - beta)
        update = reference_orthogonalise(grad.double().lerp(momentum, beta))
        weight = weight * (1 - lr * decay) - lr * update
        step_size = lr * update.abs().max()
        assert (param.detach().double() - weight).abs().max() < 1e-4 * step_size
        torch.testing.assert_close(optimizer.state[param]["momentum_buffer"].double(), momentum, rtol=0, atol=1e-6)


# --- which parameters go where, and what they cost -----------------------------------------------------------

RECIPE = {
    "name": "t",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
    "optim": {"kind": "muon"},
}


def resolve_muon(tmp_path, base: str, world: int, recipe_changes: dict | None = None, **changes):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, **(recipe_changes or {})}))
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(config))
    return resolve(load_recipe(recipe), recipe, load_ds_config(path), path, world)


def test_muon_recipe_gives_deepspeeds_muon_with_the_recipes_values(tmp_path):
    optimizer = resolve_muon(tmp_path, "zero0", 2).deepspeed_config["optimizer"]
    assert optimizer["type"] == "Muon"
    params = optimizer["params"]
    assert (params["muon_lr"], params["adam_lr"], params["momentum"], params["ns_method"]) == (0.02, 3e-4, 0.95, "gram")
    assert params["torch_adam"] is True  # the ds_config's implementation of the AdamW half is kept


@pytest.mark.parametrize(
    "base, world, changes, fragment",
    [
        ("zero2_bf16", 2, {}, "bf16 ZeRO-2 hands Muon bf16 gradients"),
        ("sp2_zero3", 2, {}, "sequence parallelism with ZeRO-3 needs reduce_scatter"),
        ("zero2_offload", 2, {}, "under ZeRO stage 2 with offload DeepSpeed 0.19.8 clips Muon's orthogonalised"),
        ("zero1_bf16", 2, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "stage 1 with offload"),
        ("sp2_zero1_bf16", 2, {}, "bf16 Muon takes dense data parallelism only"),
        ("tp2_zero1", 2, {}, "Newton-Schulz on a shard"),
        ("tp2_zero1", 2, {"zero_optimization": {"stage": 0}}, "Newton-Schulz on a shard"),
        ("pp2_zero1", 2, {}, "a pipeline's layer names would put the embedding in"),
    ],
)
def test_strategies_that_would_change_muons_math_are_refused_in_one_line(tmp_path, base, world, changes, fragment):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError) as e:
        resolve_muon(tmp_path, base, world, **changes)
    message = str(e.value)
    assert (
        "\n" not in message and "d.json" in message and "use ds_configs/zero0.json, zero1.json, zero2.json" in message
    )
    assert fragment in message, message


def test_zero3_muon_is_accepted_without_reduce_scatter_only(tmp_path):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError) as e:
        resolve_muon(tmp_path, "zero3", 2)
    assert str(e.value).endswith(
        "d.json: optim.kind=muon under ZeRO-3 needs zero_optimization.reduce_scatter: false "
        '(DeepSpeed 0.19.8 runs Muon only on all-reduced gradients there); add "reduce_scatter": false to '
        "zero_optimization"
    )
    for base in ("zero1", "zero2", "sp2_zero1"):
        assert resolve_muon(tmp_path, base, 2).deepspeed_config["optimizer"]["type"] == "Muon"
    for base in ("zero3", "zero3_bf16"):
        accepted = resolve_muon(tmp_path, base, 2, zero_optimization={"reduce_scatter": False})
        assert accepted.deepspeed_config["zero_optimization"]["reduce_scatter"] is False


def test_a_muon_ds_config_under_an_adamw_recipe_is_refused(tmp_path):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError, match='optimizer.type "Muon" but .* sets optim.kind=adamw; the recipe owns'):
        resolve_muon(tmp_path, "zero0", 2, {"optim": {"kind": "adamw"}}, optimizer={"type": "Muon"})


def test_estimate_counts_one_momentum_for_each_parameter_deepspeed_gives_muon(tmp_path):
    """The estimate's M against DeepSpeed's own tagging of a real GPT (deepspeed.set_optimizer_flags)."""
    import deepspeed

    from dstrain.model.gpt import GPT
    from dstrain.plan.memory import estimate
    from dstrain.recipe_file import load_recipe

    strategy = resolve_muon(tmp_path, "zero0", 2)
    recipe = load_recipe(tmp_path / "r.yaml")
    model = GPT(recipe.model)
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    muon = sum(p.numel() for p in model.parameters() if p.use_muon)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < muon < total
    states = {p.name: p.step for p in estimate(recipe, strategy, 1, 2).parts if p.group == "optimizer states"}
    assert states == {"Adam moments (fp32)": 8 * (total - muon), "Muon momentum (fp32)": 4 * muon}
    bf16 = estimate(recipe, resolve_muon(tmp_path, "zero1_bf16", 2), 1, 2).parts  # partitioned over 2 ranks
    assert {p.name: p.step for p in bf16}["Muon momentum (fp32)"] == 4 * math.ceil(muon / 2)
    zero2 = {p.name: p.step for p in estimate(recipe, resolve_muon(tmp_path, "zero2", 2), 1, 2).parts}
    assert zero2["Muon momentum (fp32)"] == 2 * 4 * math.ceil(muon / 2)  # and DeepSpeed's staged copy


def test_a_muon_checkpoint_is_not_converted_to_another_topology(tmp_path):
    """The universal checkpoint carries weights and Adam moments: a layout change would lose Muon's momentum."""
    from dstrain.checkpoint.record import RECORD, CheckpointRecord
    from dstrain.checkpoint.reshard import prepare_resume
    from dstrain.errors import DstrainError

    two_ranks, one_rank = resolve_muon(tmp_path, "zero1_bf16", 2), resolve_muon(tmp_path, "zero1_bf16", 1)
    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    record = CheckpointRecord(4, 0, files={}, checksums={}, hash="", topology=two_ranks.topology, identity=None)
    (tag / RECORD).write_text(record.to_json())
    with pytest.raises(DstrainError, match="a Muon run cannot change topology .* does not carry Muon's momentum"):
        prepare_resume(tag.parent, tag.name, one_rank, None, 0.1, on_rank0=lambda fn, what: fn())


# --- training: the same math under every accepted layout, and exact resume ------------------------------------


def zero3_config(folder, base: str = "zero3"):
    """``base`` with reduce_scatter off, as DeepSpeed 0.19.8's ZeRO-3 Muon needs (resolve says so)."""
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    config["zero_optimization"]["reduce_scatter"] = False
    path = folder / f"{base}_all_reduce.json"
    path.write_text(json.dumps(config))
    return path


RESUMED = {"resumed": "zero0", "resumed_zero2": "zero2_accum", "resumed_bf16": "zero1_bf16"}  # -> uninterrupted


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory, corpus):
    """The small recipe with Muon and clipping at CLIP on 2 ranks: ZeRO-0, with 2 micro-batches per step, ZeRO-1,
    ZeRO-2 with 2 micro-batches, ZeRO-3, Ulysses SP2 (ZeRO-1, 2 micro-batches), ZeRO-1 and ZeRO-3 bf16; ZeRO-0, ZeRO-2
    and bf16 ZeRO-1 interrupted after step 4 and resumed (ZeRO-0 on 2 ranks, and on 1: steps 5-10 on one rank)."""
    tmp = tmp_path_factory.mktemp("muon")
    recipe = small_recipe(tmp, corpus, optim={"kind": "muon", "grad_clip": CLIP})
    configs = {
        "zero0_accum": ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=2),
        "zero1": "zero1",
        "zero2_accum": ds_config(tmp, "zero2", train_micro_batch_size_per_gpu=2),
        "zero3": zero3_config(tmp),
        "sp2_zero1": "sp2_zero1",
        "zero1_bf16": "zero1_bf16",
        "zero3_bf16": zero3_config(tmp, "zero3_bf16"),
    }
    configs.update({name: configs.get(base, "zero0") for name, base in RESUMED.items()})
    runs = {name: tmp / name for name in ("zero0", *configs, "resumed_on_one_rank")}
    argv = {name: train_argv(recipe, configs.get(name, "zero0"), run) for name, run in runs.items()}
    trained = ["zero0", *(name for name in configs if name not in RESUMED)]
    assert run_ranks(2, train_each, [argv[name] for name in trained]) == [[0] * len(trained)] * 2
    for name in RESUMED:
        assert run_ranks(2, train_and_signal_at, [*argv[name], "train.checkpoint_interval=3"], 4) == [0, 0]
    shutil.copytree(runs["resumed"], runs["resumed_on_one_rank"])
    assert run_ranks(2, train_each, [argv[name] for name in RESUMED]) == [[0] * len(RESUMED)] * 2
    assert run_ranks(1, train_each, [argv["resumed_on_one_rank"]]) == [[0]]
    return runs


def grad_norms(run) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run) if "split" not in r]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zero0_accum", "zero1", "zero2_accum", "zero3", "sp2_zero1", "resumed_on_one_rank"])
def test_muon_gives_the_same_losses_and_grad_norms_under_every_accepted_layout(muon_runs, layout):
    reference, norms = train_losses(muon_runs["zero0"]), grad_norms(muon_runs["zero0"])
    assert len(reference) == 10 and min(norms) > CLIP  # every step clipped
    assert reference[-1] < reference[0] - 0.3  # and Muon learns (0.45 measured in 10 steps)
    np.testing.assert_allclose(train_losses(muon_runs[layout]), reference, rtol=MUON_RTOL)
    np.testing.assert_allclose(grad_norms(muon_runs[layout]), norms, rtol=MUON_RTOL)
    assert grad_norms(muon_runs[layout])[0] == pytest.approx(norms[0], rel=STEP1_NORM_RTOL)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zero1_bf16", "zero3_bf16"])
def test_bf16_muon_clips_the_raw_gradient_too(muon_runs, layout):
    """ZeRO-1 bf16 (DeepSpeed's BF16_Optimizer) and ZeRO-3 bf16 (fp32 gradient partitions, train/engine/muon_zero.py)
    against
    ZeRO-0 fp32: the same losses and pre-clip norms to bf16's rounding (measured 7.3e-5 and 1.6e-3, 7.1e-5 and
    1.8e-3), where a norm of the orthogonalised update would be more than twice as large
    (test_muon_zero.py::test_deepspeed_zero_clips_the_orthogonalised_update)."""
    np.testing.assert_allclose(train_losses(muon_runs[layout]), train_losses(muon_runs["zero0"]), rtol=1e-3)
    np.testing.assert_allclose(grad_norms(muon_runs[layout]), grad_norms(muon_runs["zero0"]), rtol=5e-3)


def optimizer_state(run, tag: str) -> dict:
    from dstrain.checkpoint.ds_files import ZERO12_MODEL_FILE, read_pt

    return read_pt(run / "checkpoints" / tag / ZERO12_MODEL_FILE)["optimizer"]


@pytest.mark.distributed
def test_muon_keeps_a_momentum_for_matrices_and_adam_moments_for_the_rest(muon_runs):
    optimizer = optimizer_state(muon_runs["zero0"], "global_step10")
    kinds = {group["name"]: group["use_muon"] for group in optimizer["param_groups"]}
    assert kinds == {"decay-muon-params": True, "decay-adam-params": False, "no_decay-adam-params": False}
    for group in optimizer["param_groups"]:
        for index in group["params"]:
            keys = set(optimizer["state"][index])
            assert keys == ({"momentum_buffer"} if group["use_muon"] else {"exp_avg", "exp_avg_sq", "step"}), keys


def tensors(tree, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path of keys."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else []
    return {key: value for k, v in items for key, value in tensors(v, f"{path}/{k}").items()}


def checkpoint_tensors(run, tag: str) -> dict[str, torch.Tensor]:
    from dstrain.checkpoint.ds_files import read_pt

    files = sorted((run / "checkpoints" / tag).glob("*.pt"))
    found = {key: value for file in files for key, value in tensors(read_pt(file), file.name).items()}
    return {key: value for key, value in found.items() if value.is_floating_point()}  # not the RNG states


@pytest.mark.distributed
@pytest.mark.parametrize("resumed", RESUMED)
def test_resume_keeps_muons_momentum_bit_for_bit(muon_runs, resumed):
    """SIGUSR1 after step 4: the resumed run's steps 5..10, its grad norms and its final checkpoint (weights, Muon's
    momentum, Adam's moments, in every rank's file) are the uninterrupted run's, under ZeRO-0, ZeRO-2 fp32 (momentum
    and gradient partitions of whole matrices) and bf16 ZeRO-1 (BF16_Optimizer's fp32 momentum)."""
    uninterrupted = muon_runs[RESUMED[resumed]]
    assert train_losses(muon_runs[resumed]) == train_losses(uninterrupted)
    assert grad_norms(muon_runs[resumed]) == grad_norms(uninterrupted)
    saved, expected = (
        checkpoint_tensors(muon_runs[resumed], "global_step10"),
        checkpoint_tensors(uninterrupted, "global_step10"),
    )
    assert saved.keys() == expected.keys() and any("momentum_buffer" in key for key in expected), sorted(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key


# --- dstrain compare: AdamW and Muon side by side ---------------------------------------------------------------


def test_compare_entries_carry_their_own_recipe_overrides():
    from dstrain.commands.compare import split_entries

    entries, overrides = split_entries(["ds_configs/zero0.json", "ds_configs/zero0.json+optim.kind=muon", "seed=3"])
    assert entries == [
        ("zero0", "ds_configs/zero0.json", []),
        ("zero0+optim.kind=muon", "ds_configs/zero0.json", ["optim.kind=muon"]),
    ]
    assert overrides == ["seed=3"]


def test_compare_refuses_a_muon_entry_under_offload_before_launching(tmp_path, capsys):
    from dstrain.commands.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "optim": {}}))
    zero0, offload = ROOT / "ds_configs" / "zero0.json", ROOT / "ds_configs" / "zero2_offload.json"
    argv = ["compare", "--recipe", str(recipe), "--nproc", "2", "--out", str(tmp_path / "out")]
    assert main([*argv, "--deepspeed_configs", str(zero0), f"{offload}+optim.kind=muon"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "zero2_offload.json: optim.kind=muon is refused: under ZeRO stage 2 with offload" in error
    assert not (tmp_path / "out").exists()  # nothing launched


def test_an_adamw_checkpoint_is_not_resumed_with_muon(tmp_path):
    """The checkpoint holds AdamW's moments: continuing it with Muon is another experiment (optim.kind is identity)."""
    from dstrain.checkpoint.record import RECORD, CheckpointRecord, identity
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.train.preflight import check_run_dir

    topology = resolve_muon(tmp_path, "zero0", 2).topology  # writes r.yaml, a Muon recipe
    muon = load_recipe(tmp_path / "r.yaml")
    adamw = load_recipe(tmp_path / "r.yaml", ["optim.kind=adamw"])
    tag = tmp_path / "run" / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    record = CheckpointRecord(4, 0, {}, {}, "", topology, identity=identity(adamw, "data"))
    (tag / RECORD).write_text(record.to_json())
    check_run_dir(adamw, "r.yaml", RunDir(tmp_path / "run"), tag.name, "auto", "data")  # the same experiment resumes
    with pytest.raises(DstrainError, match=r"holds a run of a different recipe \(optimizer differ from r.yaml\)"):
        check_run_dir(muon, "r.yaml", RunDir(tmp_path / "run"), tag.name, "auto", "data")
