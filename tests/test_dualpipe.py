"""DualPipeV (DeepSpeed's DualPipeVModule, ds_config "pipeline.schedule": "dualpipev") on 2 gloo ranks, fp32: the
plain model's and the 1F1B pipeline's losses and pre-clip gradient norms, exact resume, conversion to one stage and
to 1F1B through the universal checkpoint, and the refusals of what it cannot do."""

import json
import shutil

import numpy as np
import pytest
import yaml

from ranks import run_ranks
from train_helpers import (
    ROOT,
    ds_config,
    read_metrics,
    small_recipe,
    train_argv,
    train_losses,
)

# fp32 on CPU: the same sums in another order (micro-batches of 2 on two ranks; measured: at most 5.4e-7). A dropped
# micro-batch, a gradient lost at the turn-around or the tied head's gradient counted twice moves losses by 1e-2.
LOSS_RTOL = 1e-5
DUALPIPEV = {"stages": 2, "schedule": "dualpipev"}
NARROW = {"lr": 2e-2, "min_lr": 2e-3}  # a 16-wide model learns visibly in 10 steps at this rate


def norms(run_dir):
    return [r["grad_norm"] for r in read_metrics(run_dir) if "split" not in r]


def evals(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if r.get("split") == "valid"]


def branch(run, dest, step=4):
    """A copy of ``run`` as it was when its checkpoint ``step`` was the newest."""
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(*(f"global_step{s}" for s in (8, 10))))
    (dest / "checkpoints" / "latest").write_text(f"global_step{step}")
    return dest


def run_each(calls: list) -> list:
    """Rank target: each (function name, args) of train_helpers in turn, in one process group."""
    import train_helpers

    return [getattr(train_helpers, name)(*args) for name, args in calls]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """gpt2 (tied head, blocks recomputed) and llama with document masking, 4 blocks, micro-batches of 2 (4 per
    step, the fewest DualPipeV takes on 2 ranks); the llama is 16 wide, so that its first and last virtual stages
    hold the embedding and the head alone and rank 0 has no 1-D parameter
    (test_a_stage_without_a_no_decay_group_is_covered), 10 steps under ZeRO-1, 1F1B and DualPipeV; the gpt2
    DualPipeV run again under ZeRO-0 and interrupted at step 4; then branches of the DualPipeV runs at step 4
    continue on one stage and under 1F1B. 29 eval samples: a short last micro-batch. About 25 s on 2 idle cores."""
    tmp = tmp_path_factory.mktemp("dualpipe")
    train = {"eval_samples": 29, "checkpoint_interval": 4, "keep_last": 3}
    gpt2 = {"flavour": "gpt2", "n_kv_head": None, "n_layer": 4}
    recipes = {
        "gpt2": small_recipe(tmp, corpus, "gpt2", model=gpt2, train=train),
        "llama": small_recipe(
            tmp, corpus, "llama", model={"n_layer": 4, "d_model": 16, "doc_masking": True}, train=train, optim=NARROW
        ),
    }
    micro2 = {"train_micro_batch_size_per_gpu": 2}
    configs = {
        "zero1": ds_config(tmp, "zero1", **micro2),
        "1f1b": ds_config(tmp, "pp2_zero1", **micro2),
        "dualpipev": ds_config(tmp, "pp2_zero1", **micro2, pipeline=DUALPIPEV),
        "dualpipev_recompute": ds_config(
            tmp, "pp2_zero1", **micro2, pipeline={**DUALPIPEV, "activation_checkpoint_interval": 1}
        ),
        "dualpipev_zero0": ds_config(tmp, "pp2_zero1", **micro2, pipeline=DUALPIPEV, zero_optimization={"stage": 0}),
        "dualpipev_chunked": ds_config(tmp, "pp2_zero1", **micro2, pipeline=DUALPIPEV, tiling={"loss": 4}),
    }
    schedule = {"gpt2": "dualpipev_recompute", "llama": "dualpipev"}
    d = {f"{m}_{c}": tmp / f"{m}_{c}" for m in recipes for c in ("zero1", "1f1b", "dualpipev")}
    d.update(gpt2_zero0=tmp / "gpt2_zero0", gpt2_resumed=tmp / "gpt2_resumed", gpt2_chunked=tmp / "gpt2_chunked")
    argvs = [
        *(train_argv(recipes[m], configs[c], d[f"{m}_{c}"]) for m in recipes for c in ("zero1", "1f1b")),
        *(train_argv(recipes[m], configs[schedule[m]], d[f"{m}_dualpipev"]) for m in recipes),
        train_argv(recipes["gpt2"], configs["dualpipev_zero0"], d["gpt2_zero0"]),
        # the chunked loss on rank 0, which holds the tied head and the embedding both
        train_argv(recipes["gpt2"], configs["dualpipev_chunked"], d["gpt2_chunked"]),
    ]
    resumed = train_argv(recipes["gpt2"], configs[schedule["gpt2"]], d["gpt2_resumed"])
    calls = [*(("train", [a]) for a in argvs), ("train_and_signal_at", [resumed, 4]), ("train", [resumed])]
    assert run_ranks(2, run_each, calls) == [[0] * len(calls)] * 2
    later = []
    for m in recipes:
        for target in ("zero1", "1f1b"):
            d[f"{m}_to_{target}"] = branch(d[f"{m}_dualpipev"], tmp / f"{m}_to_{target}")
            later.append(("train", [train_argv(recipes[m], configs[target], d[f"{m}_to_{target}"])]))
    assert run_ranks(2, run_each, later) == [[0] * len(later)] * 2
    return d


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("reference", ["zero1", "1f1b"])
def test_dualpipev_gives_the_losses_and_norms_of(runs, model, reference):
    expected, losses = train_losses(runs[f"{model}_{reference}"]), train_losses(runs[f"{model}_dualpipev"])
    assert len(losses) == len(expected) == 10
    np.testing.assert_allclose(losses, expected, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norms(runs[f"{model}_dualpipev"]), norms(runs[f"{model}_{reference}"]), rtol=LOSS_RTOL)
    np.testing.assert_allclose(evals(runs[f"{model}_dualpipev"]), evals(runs[f"{model}_{reference}"]), rtol=LOSS_RTOL)
    assert expected[-1] < expected[0] - 0.3  # and the model learns


@pytest.mark.distributed
def test_dualpipev_with_the_chunked_loss_gives_the_zero1_losses_and_norms(runs):
    """The tied gpt2 with its loss in 4 chunks on DualPipeV's rank 0 (the head and the embedding on one rank)."""
    got, want = runs["gpt2_chunked"], runs["gpt2_zero1"]
    np.testing.assert_allclose(train_losses(got), train_losses(want), rtol=LOSS_RTOL)
    np.testing.assert_allclose(norms(got), norms(want), rtol=LOSS_RTOL)
    np.testing.assert_allclose(evals(got), evals(want), rtol=LOSS_RTOL)


@pytest.mark.distributed
def test_a_stage_without_a_no_decay_group_is_covered(runs):
    """The llama's rank 0 (embedding and head) saved one parameter group, rank 1 two: DeepSpeed's ZeRO-1 norm hangs on
    that unpadded (train/engine/grad_norm.py::pad_group_norms) and its universal conversion loses the second group
    unless
    the stages' groups are joined (checkpoint/reshard.py::_groups_of_every_stage); the tests above pass through both."""
    from dstrain.checkpoint.ds_files import read_pt

    tag = runs["llama_dualpipev"] / "checkpoints" / "global_step4"
    files = [tag / f"zero_pp_rank_0_mp_rank_0{stage}_optim_states.pt" for stage in (0, 1)]
    groups = [len(read_pt(f)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]) for f in files]
    assert groups == [1, 2]


@pytest.mark.distributed
def test_dualpipev_under_zero0_takes_the_global_norm(runs):
    """ZeRO-0: dstrain's own pre-clip norm (train/engine/grad_norm.py) over both of each rank's stages."""
    np.testing.assert_allclose(norms(runs["gpt2_zero0"]), norms(runs["gpt2_zero1"]), rtol=LOSS_RTOL)
    np.testing.assert_allclose(train_losses(runs["gpt2_zero0"]), train_losses(runs["gpt2_zero1"]), rtol=LOSS_RTOL)


@pytest.mark.distributed
def test_dualpipev_resumes_exactly(runs):
    """SIGUSR1 after step 4 -> checkpoint; the resumed run's steps 5..10 are the uninterrupted run's, bit for bit."""
    assert train_losses(runs["gpt2_resumed"]) == train_losses(runs["gpt2_dualpipev"])
    assert norms(runs["gpt2_resumed"]) == norms(runs["gpt2_dualpipev"])


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("target", ["zero1", "1f1b"])
def test_dualpipev_checkpoint_continues_on_another_layout(runs, model, target):
    """Through the universal checkpoint: one stage (ZeRO-1 on 2 ranks), or the same 2 stages under 1F1B, whose ranks
    hold other layers than DualPipeV's (the recorded topology names the schedule)."""
    run, expected = runs[f"{model}_to_{target}"], train_losses(runs[f"{model}_dualpipev"])
    assert (run / "checkpoints" / "global_step4" / "universal" / "zero").is_dir()
    losses = train_losses(run)
    assert len(losses) == 10 and losses[:4] == expected[:4]
    np.testing.assert_allclose(losses[4:], expected[4:], rtol=LOSS_RTOL)


# --- refusals, before any process group ---------------------------------------------------------------------


def resolve_with(tmp_path, world: int, n_layer: int = 4, **changes):
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe = tmp_path / "r.yaml"
    model = {"flavour": "gpt2", "n_layer": n_layer, "n_head": 4, "d_model": 32, "vocab_size": 512}
    data = {"sources": [{"path": "data/none"}], "seq_len": 16}
    recipe.write_text(
        yaml.safe_dump({"name": "r", "model": model, "data": data, "train": {"global_batch": 8, "steps": 4}})
    )
    config = json.loads((ROOT / "ds_configs" / "pp2_zero1.json").read_text())
    config.update(changes)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(config))
    return resolve(load_recipe(recipe), recipe, load_ds_config(path), path, world)


def test_dualpipev_resolves_with_enough_micro_batches(tmp_path):
    strategy = resolve_with(tmp_path, 2, train_micro_batch_size_per_gpu=2, pipeline=DUALPIPEV)
    assert (strategy.pp_stages, strategy.grad_accum, strategy.pipe_schedule) == (2, 4, "dualpipev")
    assert strategy.topology.pipe_schedule == "dualpipev"
    assert resolve_with(tmp_path, 2).pipe_schedule == "1f1b"


@pytest.mark.parametrize(
    "world, n_layer, changes, fragments",
    [
        (
            2,
            4,
            {"pipeline": DUALPIPEV},
            ["2 x pipeline.stages = 4 micro-batches", "gives 2", "micro_batch_size_per_gpu to 2"],
        ),
        (4, 4, {"pipeline": DUALPIPEV}, ["gives 1", "micro_batch_size_per_gpu to 1"]),  # 2 replicas x 4 samples
        (
            8,
            4,
            {"pipeline": DUALPIPEV, "train_micro_batch_size_per_gpu": 2},
            ["raise the recipe's train.global_batch"],
        ),  # 4 replicas x 2 samples
        (2, 3, {"pipeline": DUALPIPEV, "train_micro_batch_size_per_gpu": 2}, ["4 stages, more than the 3 blocks"]),
        (2, 4, {"pipeline": {"stages": 2, "schedule": "zb1p"}}, ["pipeline.schedule='zb1p'", '"dualpipev"']),
    ],
)
def test_dualpipev_refusals_are_one_line(tmp_path, world, n_layer, changes, fragments):
    from dstrain.errors import DstrainError

    with pytest.raises(DstrainError) as e:
        resolve_with(tmp_path, world, n_layer, **changes)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / "d.json"))
    for fragment in fragments:
        assert fragment in str(e.value)
