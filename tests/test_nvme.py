"""ZeRO-Infinity on 2 CPU ranks (fp32): parameters and optimizer state swapped to a folder through DeepSpeed's async_io
op train as ZeRO-3 does, resume exactly, export the same weights, and refuse what they cannot become.

DeepSpeed swaps only tensors of at least 1 MiB per rank (swap_tensor/utils.py MIN_AIO_BYTES), so the model here is
wider than small_recipe's: 1.44M parameters, whose matrices (2.9 MB per rank) and embedding and head partitions
(1 MiB each) go to the swap folder while the norms stay in memory, both kinds of sub-group a real run has.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from ranks import run_ranks
from train_helpers import nvme_config, read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

MODEL = {"d_model": 128, "vocab_size": 4096}
# Two strategies' fp32 losses differ by reduction order, amplified by Adam (tests/test_train.py's LOSS_RTOL).
LOSS_RTOL = 1e-4
# Weights after 10 steps: the same rounding, measured 3.7e-7 absolute; a lost update moves them by ~lr = 3e-3.
WEIGHT_ATOL = 1e-5


def loss_and_norms(run_dir) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "split" not in r]


def optimizer_view(engine) -> dict:
    """What a resume must restore, on this rank: Adam's step per sub-group, the groups' lr, the loss scale, and the
    sub-groups kept in memory (too small to swap)."""
    wrapper = engine.optimizer
    inner = wrapper.optimizer
    return {
        "steps": [int(inner.state[flat].get("step", 0)) for flat in wrapper.fp32_partitioned_groups_flat],
        "lrs": [group["lr"] for group in inner.param_groups],
        "loss_scale": float(wrapper.loss_scale),
        "in_memory": [
            flat.detach().tolist()  # plain lists: tensors would not outlive the rank on their way back
            for i, flat in enumerate(wrapper.fp32_partitioned_groups_flat)
            if not wrapper._swappable_optimizer_subgroup(i)
        ],
    }


def train_resume_probing(runs: list[list[str]], resume: list[str]) -> dict:
    """Rank target: train each of ``runs``, keeping their losses and grad norms; then ``resume`` one of them, keeping
    the optimizer as DeepSpeed's load left it and as dstrain's restore leaves it."""
    from dstrain.checkpoint import nvme
    from dstrain.train.run import main

    def run_dir(argv):
        return next(a.removeprefix("run_dir=") for a in argv if a.startswith("run_dir="))

    result = {"codes": [], "runs": []}
    for argv in runs:
        result["codes"].append(main(argv))
        result["runs"].append(loss_and_norms(run_dir(argv)))
    original = nvme.restore_what_deepspeed_skips

    def probed(engine, load_dir, tag):
        result["loaded"] = optimizer_view(engine)
        original(engine, load_dir, tag)
        result["restored"] = optimizer_view(engine)

    nvme.restore_what_deepspeed_skips = probed
    result["codes"].append(main(resume))
    result["resumed"] = loss_and_norms(run_dir(resume))
    return result


@pytest.fixture(scope="module")
def nvme_runs(tmp_path_factory, corpus, async_io):
    """One process group: ZeRO-3 and ZeRO-Infinity, 10 steps each (checkpoints at 4 and 8 and 10), then the NVMe run
    resumed from its step 4 in its own folder (as after a stop there) up to step 10."""
    if async_io:
        pytest.skip(async_io)
    tmp = tmp_path_factory.mktemp("nvme")
    recipe = small_recipe(tmp, corpus, model=MODEL, train={"checkpoint_interval": 4, "keep_last": 3})
    config = nvme_config(tmp)
    zero3, nvme = tmp / "zero3", tmp / "nvme"
    runs = [train_argv(recipe, "zero3", zero3), train_argv(recipe, config, nvme)]
    results = run_ranks(2, train_resume_probing, runs, ["--resume", "global_step4", *train_argv(recipe, config, nvme)])
    assert [r["codes"] for r in results] == [[0, 0, 0]] * 2
    return {"recipe": recipe, "config": config, "zero3": zero3, "nvme": nvme, "ranks": results}


def test_nvme_trains_as_zero3(nvme_runs):
    """Same losses and pre-clip grad norms for 10 steps; step 1 differs by the reduction order alone."""
    zero3, nvme = nvme_runs["ranks"][0]["runs"]
    assert len(zero3) == len(nvme) == 10
    np.testing.assert_allclose(nvme, zero3, rtol=LOSS_RTOL)
    assert nvme[0][1] == pytest.approx(zero3[0][1], rel=1e-6)
    assert zero3[-1][0] < zero3[0][0] - 0.3  # it learns
    swapped = list((nvme_runs["nvme"] / "checkpoints" / "global_step10" / "offloaded_tensors").rglob("*.swp"))
    assert swapped, "nothing was swapped: the test model is below DeepSpeed's MIN_AIO_BYTES"


def test_nvme_resume_continues_exactly(nvme_runs):
    """Resumed at step 4, steps 5..10 are the uninterrupted run's, bit for bit, losses and grad norms."""
    rank0 = nvme_runs["ranks"][0]
    uninterrupted, resumed = rank0["runs"][1], rank0["resumed"]
    assert resumed == uninterrupted
    next_lr = next(r["lr"] for r in read_metrics(nvme_runs["nvme"]) if r["step"] == 5 and "split" not in r)
    for rank in nvme_runs["ranks"]:
        restored = rank["restored"]
        assert set(restored["steps"]) == {4}  # every sub-group's Adam step, swapped or not
        assert restored["lrs"] == [next_lr, next_lr]


@pytest.mark.deepspeed_defect("engine.load_checkpoint skips the ZeRO optimizer state under NVMe offload")
def test_deepspeed_skips_the_optimizer_load_under_nvme(nvme_runs):
    """What DeepSpeed 0.19.8's own load leaves (nvme.restore_what_deepspeed_skips fills it in): Adam's step counts
    and the in-memory sub-groups as a fresh engine made them. Fails once DeepSpeed restores them itself."""
    for rank in nvme_runs["ranks"]:
        loaded, restored = rank["loaded"], rank["restored"]
        assert 4 not in loaded["steps"]
        assert loaded["in_memory"] and restored["in_memory"]
        assert not any(a == b for a, b in zip(loaded["in_memory"], restored["in_memory"]))


def test_nvme_checkpoint_exports_the_zero3_weights(nvme_runs, tmp_path):
    """`dstrain export` (and eval and generate, which read through the same consolidated_state_dict) reads the
    swapped masters from offloaded_tensors/: the weights of the ZeRO-3 run."""
    from safetensors.torch import load_file

    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.commands.cli import main

    recipe, tag_dir = load_run(nvme_runs["nvme"], None)
    _, zero3_tag = load_run(nvme_runs["zero3"], None)
    ours, theirs = consolidated_state_dict(tag_dir, recipe.model), consolidated_state_dict(zero3_tag, recipe.model)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert main(["export", str(nvme_runs["nvme"]), "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(exported["model.embed_tokens.weight"], ours["embed.tok.weight"])


def test_an_nvme_checkpoint_resumes_only_as_saved(nvme_runs, tmp_path, capfd, monkeypatch):
    """Under a ds_config without NVMe, on another rank count, or an NVMe ds_config over a checkpoint without swap
    files: one line that says why, before anything is written."""
    from dstrain.train.run import main

    recipe, config, nvme, zero3 = (nvme_runs[k] for k in ("recipe", "config", "nvme", "zero3"))
    unrecorded = shutil.copytree(nvme, tmp_path / "unrecorded", symlinks=True)
    tag_dir = unrecorded / "checkpoints" / "global_step10"
    record = json.loads((tag_dir / "dstrain_checkpoint.json").read_text())
    for layout in (tag_dir / "offloaded_tensors").glob("rank*/dstrain_subgroups.json"):
        layout.unlink()  # as in a checkpoint saved before dstrain wrote them, complete without them
        del record["files"][str(layout.relative_to(tag_dir))]
    (tag_dir / "dstrain_checkpoint.json").write_text(json.dumps(record))
    runs = (nvme, zero3, unrecorded)
    before = {p: p.stat().st_mtime_ns for run in runs for p in run.rglob("*")}
    saved_with = "resume with the ds_config and rank count it was saved with"
    cases = [
        (train_argv(recipe, "zero3", nvme), "2", "only an NVMe ds_config loads; " + saved_with),
        (train_argv(recipe, config, nvme), "1", "DeepSpeed cannot repartition them (ZeRO-3 fp32, 2 ranks -> "),
        (train_argv(recipe, config, zero3), "2", "the checkpoint has no NVMe swap files to load; " + saved_with),
        (train_argv(recipe, config, unrecorded), "2", "no record of which swap file holds what"),
    ]
    for argv, world, why in cases:
        monkeypatch.setenv("WORLD_SIZE", world)
        capfd.readouterr()
        assert main([*argv, "train.steps=12"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert {p: p.stat().st_mtime_ns for run in runs for p in run.rglob("*")} == before
    assert json.loads((nvme / "summary.json").read_text())["step"] == 10
