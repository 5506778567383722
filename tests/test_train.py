"""The trainer on 2 CPU ranks (gloo, fp32): strategy equivalence, exact resume, what a run leaves."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from ranks import run_ranks
from train_helpers import (
    QWEN3_MODEL,
    ROOT,
    ds_config,
    read_metrics,
    small_recipe,
    train_and_signal_at,
    train_argv,
    train_each,
    train_losses,
)

pytestmark = pytest.mark.distributed

# fp32 on CPU: the strategies reduce the same gradients in different orders (bucketed all-reduce, reduce-scatter,
# pre-division) and take the norm in fp64 (DeepSpeed's get_norm_dtype; train/engine/grad_norm.py for ZeRO-0), so step
# 1's
# norms agree to 7e-8 (one or two fp32 ulps) and 10 steps of losses and norms to 1.2e-7 (measured). A real defect (a
# lost init, an unscaled loss, a skipped sample) moves the losses by 1e-2 or more; a norm taken in fp32 on CPU moved
# the tiny recipe's by 1e-5.
LOSS_RTOL = 1e-6
STEP1_NORM_RTOL = 1e-7


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory, corpus):
    """One 2-rank process group trains the same recipe under every fp32 strategy, one after another."""
    tmp = tmp_path_factory.mktemp("equivalence")
    recipe = small_recipe(tmp, corpus)
    configs = {
        name: ROOT / "ds_configs" / f"{name}.json"
        for name in ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero1_fusedadam"]
    }
    configs["zero0_micro2_accum2"] = ds_config(tmp, "zero0", train_micro_batch_size_per_gpu=2)
    for name in ("zero2", "zero3"):  # the chunked loss: 4 tiles of 8 tokens (tied heads: tests/test_parallel.py)
        configs[f"{name}_chunked"] = ds_config(tmp, name, tiling={"loss": 4})
    runs = {name: tmp / name for name in configs}
    qwen3 = small_recipe(tmp, corpus, name="qwen3", model=QWEN3_MODEL)
    argvs = [train_argv(recipe, configs[n], runs[n]) for n in configs]
    for name in ("zero0", "zero3"):
        runs[f"qwen3_{name}"] = tmp / f"qwen3_{name}"
        argvs.append(train_argv(qwen3, configs[name], runs[f"qwen3_{name}"]))
    codes = run_ranks(2, train_each, argvs)
    assert codes == [[0] * len(argvs)] * 2
    return runs


@pytest.mark.parametrize(
    "strategy",
    [
        "zero1",
        "zero2",
        "zero3",
        "zero2_offload",
        "zero3_offload",
        "zero1_fusedadam",
        "zero0_micro2_accum2",
        "zero2_chunked",
        "zero3_chunked",
    ],
)
def test_strategies_give_the_same_losses(equivalence_runs, strategy):
    reference = train_losses(equivalence_runs["zero0"])
    losses = train_losses(equivalence_runs[strategy])
    assert len(losses) == len(reference) == 10
    np.testing.assert_allclose(losses, reference, rtol=LOSS_RTOL)
    # and the model learns: 0.42 measured (the first update has lr 0 since warmup starts from 0; 0.5 before)
    assert reference[-1] < reference[0] - 0.3


def test_qwen3_features_give_the_same_losses_and_grad_norms_under_zero3(equivalence_runs):
    """q/k norms, a decoupled head width and YaRN RoPE partitioned by ZeRO-3 (zero.Init builds the norms)."""
    want, got = (
        [r for r in read_metrics(equivalence_runs[n]) if "split" not in r] for n in ("qwen3_zero0", "qwen3_zero3")
    )
    assert len(got) == len(want) == 10
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=LOSS_RTOL, err_msg=key)
    assert want[-1]["loss"] < want[0]["loss"] - 0.3


def test_grad_norm_is_the_same_under_every_strategy(equivalence_runs):
    """The pre-clip global norm: computed by dstrain under ZeRO-0 (DeepSpeed keeps none), by DeepSpeed's ZeRO
    optimizers elsewhere. Step 1 has the same weights everywhere: only the reduction order differs (measured
    7e-8); later steps carry the losses' rounding (LOSS_RTOL)."""
    norms = {
        name: [r["grad_norm"] for r in read_metrics(run) if "split" not in r]
        for name, run in equivalence_runs.items()
        if not name.startswith("qwen3")
    }
    reference = norms.pop("zero0")
    assert len(reference) == 10 and all(n is not None and n > 0 for n in reference)
    for name, got in norms.items():
        assert got[0] == pytest.approx(reference[0], rel=STEP1_NORM_RTOL), name
        np.testing.assert_allclose(got, reference, rtol=LOSS_RTOL, err_msg=name)


def test_zero3_starts_from_the_same_weights(equivalence_runs):
    """zero.Init partitions each module as it is built; initialising in constructors keeps the first loss equal."""
    first = train_losses(equivalence_runs["zero3"])[0]
    assert abs(first - train_losses(equivalence_runs["zero0"])[0]) < 1e-5
    assert first < 7.0  # ln(vocab) ~ 6.4 for a well-initialised model; a broken init starts far higher


def test_run_dir_holds_what_the_run_resolved(equivalence_runs):
    run = equivalence_runs["zero2"]
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    ds = json.loads((run / "ds_config.json").read_text())
    assert recipe["train"]["steps"] == 10 and recipe["model"]["vocab_size"] % 64 == 0
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 1 and "auto" not in json.dumps(ds)
    records = read_metrics(run)
    step = records[0]
    for key in [
        "step",
        "consumed_samples",
        "consumed_tokens",
        "loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "skipped_steps",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "mem_peak_bytes",
        "elapsed_s",
    ]:
        assert key in step, key
    assert step["consumed_tokens"] == step["consumed_samples"] * 32 == 8 * 32
    assert step["tokens_per_s"] > 0 and step["tflops_per_device"] > 0 and step["mem_peak_bytes"] > 0
    assert step["mfu"] is None  # no known peak for a CPU
    evals = [r for r in records if r.get("split") == "valid"]
    assert len(evals) == 1 and abs(np.exp(evals[0]["loss"]) - evals[0]["ppl"]) < 1e-6 * evals[0]["ppl"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 10
    assert (run / "checkpoints" / "latest").read_text() == "global_step10"


def test_model_states_load_without_pickle(equivalence_runs):
    """The model states and our client state (RNG states included) load with torch.load(weights_only=True).
    DeepSpeed 0.19.8's optimizer partitions pickle its LossScaler object, so those cannot (yet)."""
    import torch

    folder = equivalence_runs["zero2"] / "checkpoints" / "global_step10"
    client = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)
    assert client["consumed_samples"] == 80 and set(client["rng"]) == {"python", "numpy", "torch"}
    with pytest.raises(Exception, match="LossScaler"):  # fails loudly once DeepSpeed stops pickling it
        torch.load(next(folder.glob("*optim_states.pt")), weights_only=True)


def test_lr_follows_the_recipe_schedule(equivalence_runs):
    from dstrain.recipe_file import load_recipe
    from dstrain.train.engine.schedule import lr_at

    recipe = load_recipe(equivalence_runs["zero1"] / "recipe.yaml")
    lrs = [r["lr"] for r in read_metrics(equivalence_runs["zero1"]) if "split" not in r]
    expected = [lr_at(s, 10, recipe.optim, recipe.schedule) for s in range(10)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12)
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(1.5e-3) and lrs[2] == pytest.approx(3e-3)  # lr·s/W from s = 0


def test_signal_checkpoints_and_resume_continues_exactly(tmp_path, corpus, equivalence_runs):
    """SIGUSR1 after step 4 -> checkpoint, exit 0; resuming gives steps 5..10 exactly as the uninterrupted run."""
    recipe = small_recipe(tmp_path, corpus)
    config = ROOT / "ds_configs" / "zero2.json"
    run = tmp_path / "run"
    assert run_ranks(2, train_and_signal_at, train_argv(recipe, config, run, "train.checkpoint_interval=3"), 4) == [
        0,
        0,
    ]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 4
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # an interrupted run draws its curve too
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["global_step3", "global_step4"]
    assert run_ranks(2, train_each, [train_argv(recipe, config, run)]) == [[0], [0]]
    losses = train_losses(run)
    assert len(losses) == 10
    assert losses == train_losses(equivalence_runs["zero2"])  # bit for bit: same data, same state, same order
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["global_step10", "global_step4"]


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_launchers_end_to_end(tmp_path, corpus, launcher):
    """The real `deepspeed` launcher and torchrun, 2 CPU ranks each, as users run them; the CSV monitor (DeepSpeed's
    csv_monitor block in the ds_config, written by dstrain.monitors) writes into the run directory."""
    recipe = small_recipe(tmp_path, corpus, train={"steps": 6, "log_interval": 2})
    config = ds_config(tmp_path, "zero1", csv_monitor={"enabled": True})
    run = tmp_path / "run"
    bin_dir = os.path.dirname(sys.executable)
    command = {
        "deepspeed": [
            f"{bin_dir}/deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(_port()),
            "--module",
            "dstrain.train",
        ],
        "torchrun": [
            f"{bin_dir}/torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_port()),
            "-m",
            "dstrain.train",
        ],
    }[launcher]
    verbose = launcher == "torchrun"  # the switch for launchers that pass no flags; deepspeed's run is quiet
    proc = subprocess.run(
        [*command, *train_argv(recipe, config, run)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DSTRAIN_VERBOSE": "1" if verbose else "0"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 6/6" in proc.stdout and f"results in {run}" in proc.stdout
    # The ranks' DeepSpeed lines (the launchers' own lines are theirs) reach the console only when verbose, and
    # always each rank's log, which also holds a copy of the console.
    console = proc.stdout + proc.stderr
    assert ("Initializing TorchBackend in DeepSpeed" in console) == verbose
    assert ("] [DeepSpeed " in console) == verbose  # any rank-side record, e.g. "Setting accelerator to CPU"
    for rank in (0, 1):
        assert "[INFO] [DeepSpeed comm.py" in (run / "logs" / f"rank{rank}.log").read_text()
    assert "step 6/6" in (run / "logs" / "rank0.log").read_text()
    assert f"loss curve: {run / 'loss.png'}" in proc.stdout.splitlines()
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stdout.count("step 2/6") == 1  # rank 0 alone prints
    assert [r["step"] for r in read_metrics(run) if "split" not in r] == [2, 4, 6]
    loss_csv = run / "csv" / "small" / "train_loss.csv"
    assert len(loss_csv.read_text().splitlines()) == 1 + 3  # header + one row per logged step


# A bad ds_config under `python -m dstrain.train`: one line, exit 2, nothing written (tests/test_bad_input.py:
# "inconsistent batch arithmetic" in one process, test_the_cli_reports_bad_input_the_same_way as a subprocess).


def _port():
    from ranks import free_port

    return free_port()


def test_partitioned_parameters_keep_their_weight_decay_group():
    """zero.Init leaves each parameter 1-D (shape [0]) with its real shape in ds_shape: a 4x4 weight must still
    decay and a norm must not, or ZeRO-3 silently trains without weight decay."""
    import torch

    from dstrain.train.engine.build import param_groups

    module = torch.nn.Module()
    module.weight, module.norm = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    module.weight.ds_shape, module.norm.ds_shape = torch.Size([4, 4]), torch.Size([4])
    decay, no_decay = param_groups(module, 0.1)
    assert [p is module.weight for p in decay["params"]] == [True] and decay["weight_decay"] == 0.1
    assert [p is module.norm for p in no_decay["params"]] == [True] and no_decay["weight_decay"] == 0.0


def test_torch_still_honours_a_build_lock_of_any_age(tmp_path):
    """torch's JIT build lock has no owner or expiry, so a killed build blocks every later one (why
    engine.warn_stale_build_locks exists). When this fails, torch breaks stale locks itself."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (0, 0))  # 1970
    assert not FileBaton(str(lock)).try_acquire()


def test_a_lock_left_by_a_killed_op_build_is_named(tmp_path, monkeypatch, capsys):
    from dstrain.train.engine.build import STALE_BUILD_LOCK_S, warn_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for op, age in [("cpu_adam", STALE_BUILD_LOCK_S + 60), ("fused_adam", 60)]:  # the second one is still building
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").touch()
        mtime = (tmp_path / op / "lock").stat().st_mtime - age
        os.utime(tmp_path / op / "lock", (mtime, mtime))
    assert warn_stale_build_locks() == [tmp_path / "cpu_adam" / "lock"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dstrain: warning: ") and "cpu_adam/lock is 31 minutes old: a killed build" in line
