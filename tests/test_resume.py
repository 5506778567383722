"""Resume follows the current recipe and never mixes two runs (2 CPU ranks, fp32).

A fresh start moves a previous run aside; keep-last prunes in save order; the checkpoint's own record says which
experiment it belongs to; a changed optimizer, schedule or length applies from the first resumed step under every
strategy; activation checkpointing (a ds_config setting) may change on resume.
"""

import json
import shutil

import numpy as np
import pytest
import yaml

from ranks import run_ranks
from train_helpers import ds_config, read_events, read_metrics, small_recipe, train_argv, train_each, train_losses

pytestmark = pytest.mark.distributed

STRATEGIES = ["zero0", "zero1", "zero2", "zero3", "pp2_zero1", "tp2_zero1"]
# Every optimizer value changed at once, and a schedule whose step 2 of 4 lies inside the decay (warmup 1).
CHANGED = [
    "optim.lr=1e-4",
    "optim.min_lr=1e-5",
    "optim.weight_decay=0.05",
    "optim.grad_clip=0.25",
    "optim.betas=[0.8, 0.9]",
    "optim.eps=1e-6",
    "schedule.kind=linear",
    "schedule.warmup_steps=1",
]


def tags(checkpoints):
    return sorted(p.name for p in checkpoints.iterdir() if p.is_dir())


def record(tag_dir):
    return json.loads((tag_dir / "dstrain_checkpoint.json").read_text())


def branch(run, dest, step):
    """A copy of ``run`` as it was when its checkpoint ``step`` was the newest."""
    shutil.copytree(run, dest)
    for tag in tags(dest / "checkpoints"):
        if int(tag.removeprefix("global_step")) > step:
            shutil.rmtree(dest / "checkpoints" / tag)
    (dest / "checkpoints" / "latest").write_text(f"global_step{step}")
    lines = (dest / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))
    return dest


# --- item 1: --resume none never deletes or mixes ------------------------------------------------------------


def resume_none_runs(recipe, run) -> list[list[str]]:
    """Run A (seed 1234, checkpoints 2 and 4); run B with --resume none (seed 99, 2 steps, keep_last=1); B relaunched
    (as a Slurm requeue does), 4 steps. In `resumed`'s first process group."""
    a = train_argv(recipe, "zero1", run, "seed=1234", "train.steps=4", "train.checkpoint_interval=2")
    b = train_argv(recipe, "zero1", run, "seed=99", "train.steps=2", "train.keep_last=1")
    return [a, ["--resume", "none", *b], [*b, "train.steps=4"]]


def test_resume_none_moves_the_previous_run_aside_and_a_relaunch_continues_the_new_one(resumed):
    """B's relaunch resumes B's own checkpoint, not A's higher-numbered one; A is moved aside whole."""
    run = resumed[1]["resume-none"]
    out = (run / "logs" / "rank0.log").read_text()  # B's console, both launches (a resumed run appends)
    (previous,) = (run / "previous").iterdir()
    assert f"{run} held a previous run; moved it to {previous}/" in out
    assert tags(previous / "checkpoints") == ["global_step2", "global_step4"]  # A, whole
    assert record(previous / "checkpoints" / "global_step4")["identity"]["seed"] == 1234
    assert yaml.safe_load((previous / "recipe.yaml").read_text())["seed"] == 1234
    assert [r["step"] for r in read_metrics(previous) if "split" not in r] == [1, 2, 3, 4]
    assert "resumed from global_step2: step 2" in out and "global_step4: step 4" not in out
    assert "the recipe changed since the checkpoint, the current one applies: train.steps 2 → 4\n" in out
    assert tags(run / "checkpoints") == ["global_step4"]  # B's step 4 (keep_last=1 pruned B's step 2)
    assert record(run / "checkpoints" / "global_step4")["identity"]["seed"] == 99
    assert [r["step"] for r in read_metrics(run) if "split" not in r] == [1, 2, 3, 4]
    assert read_events(run) == [
        {"step": 2, "event": "resume", "tag": "global_step2", "changed": {"train.steps": [2, 4]}}
    ]
    assert train_losses(run)[0] != train_losses(previous)[0]  # B's own weights (seed 99), not A's


def test_keep_last_and_resume_follow_the_save_order(tmp_path):
    """A tag of a longer branch (step 8, saved first) never outranks the checkpoint saved after it (step 6)."""
    from dstrain.checkpoint.record import RECORD, CheckpointRecord
    from dstrain.checkpoint.store import newest_complete, published_tags
    from dstrain.strategy.topology import Topology

    checkpoints = tmp_path / "checkpoints"
    one_rank = Topology(world_size=1, zero_stage=0, dp_size=1, tp_size=1, pp_stages=1, precision="fp32")
    for seq, step in [(1, 8), (2, 6)]:
        (checkpoints / f"global_step{step}").mkdir(parents=True)
        record = CheckpointRecord(step, seq, files={}, checksums={}, hash="", topology=one_rank, identity=None)
        (checkpoints / f"global_step{step}" / RECORD).write_text(record.to_json())
    assert published_tags(checkpoints) == ["global_step8", "global_step6"]
    assert newest_complete(checkpoints) == "global_step6"
    (checkpoints / "latest").write_text("global_step8")  # a complete `latest` is what a resume takes
    assert newest_complete(checkpoints) == "global_step8"


# --- item 2: the current recipe is the truth on resume --------------------------------------------------------


def train_probing_first_step(args: list[str]):
    """Rank target: train, recording what the optimizer holds as the first step after the start runs."""
    from dstrain.train.loop import Trainer
    from dstrain.train.run import main

    seen = {}
    original = Trainer.train_step

    def train_step(self, batches):
        if not seen:
            engine, wrapper, clips = self.engine, self.engine.optimizer, []
            while wrapper is not None:
                if hasattr(wrapper, "clip_grad"):
                    clips.append(float(wrapper.clip_grad))
                wrapper = getattr(wrapper, "optimizer", None)
            seen.update(
                groups=[
                    {"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": list(g["betas"]), "eps": g["eps"]}
                    for g in engine.optimizer.param_groups
                ],
                engine_clip=float(engine.gradient_clipping()),
                clips=clips,
                base_lrs=list(engine.lr_scheduler.base_lrs),
            )
        return original(self, batches)

    Trainer.train_step = train_step
    try:
        return main(args), seen
    finally:
        Trainer.train_step = original


def train_counting_checkpointed_blocks(args: list[str]):
    """Rank target: train, counting the blocks run through DeepSpeed's activation checkpointing."""
    import deepspeed

    from dstrain.train.run import main

    calls = []
    original = deepspeed.checkpointing.checkpoint

    def counted(function, *inputs):
        calls.append(1)
        return original(function, *inputs)

    deepspeed.checkpointing.checkpoint = counted
    try:
        return main(args), len(calls)
    finally:
        deepspeed.checkpointing.checkpoint = original


def run_calls(calls: list) -> list:
    return [target(args) for target, args in calls]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, corpus):
    """4 steps (checkpoints 2, 4) under each strategy; then, in one process group: each branched at step 2 and
    resumed with CHANGED; zero1 extended 4 -> 8 steps; zero1 branched at 2 and resumed with activation
    checkpointing switched on in its ds_config."""
    tmp = tmp_path_factory.mktemp("resume")
    recipe = small_recipe(tmp, corpus, train={"steps": 4, "checkpoint_interval": 2})
    base = {s: tmp / f"base-{s}" for s in STRATEGIES}
    base["resume-none"] = tmp / "resume-none"
    first = [train_argv(recipe, s, base[s]) for s in STRATEGIES]
    first += resume_none_runs(small_recipe(tmp, corpus, name="small-a"), base["resume-none"])
    assert run_ranks(2, train_each, first) == [[0] * len(first)] * 2
    checkpointing = ds_config(tmp, "zero1", activation_checkpointing={"partition_activations": False})
    dirs = {s: branch(base[s], tmp / f"changed-{s}", 2) for s in STRATEGIES}
    dirs["extended"] = branch(base["zero1"], tmp / "extended", 4)
    dirs["checkpointing"] = branch(base["zero1"], tmp / "checkpointing", 2)
    calls = [(train_probing_first_step, train_argv(recipe, s, dirs[s], *CHANGED)) for s in STRATEGIES]
    calls += [
        (train_probing_first_step, train_argv(recipe, "zero1", dirs["extended"], "train.steps=8")),
        (train_counting_checkpointed_blocks, train_argv(recipe, checkpointing, dirs["checkpointing"])),
    ]
    results = run_ranks(2, run_calls, calls)
    names = [*STRATEGIES, "extended", "checkpointing"]
    return recipe, base, {n: (dirs[n], results[0][i], results[1][i]) for i, n in enumerate(names)}


def test_a_checkpoint_of_another_experiment_is_refused_by_its_own_record(resumed, tmp_path, capfd):
    """run_dir's recipe.yaml says seed 1234 (it was swapped), the checkpoint says 7: the checkpoint decides, in one
    line, before anything is written."""
    from dstrain.train.run import main

    recipe, base, _ = resumed
    run = shutil.copytree(base["zero1"], tmp_path / "run")
    recipe_yaml = yaml.safe_load((run / "recipe.yaml").read_text())
    (run / "recipe.yaml").write_text(yaml.safe_dump({**recipe_yaml, "seed": 1234}))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    capfd.readouterr()
    assert main(train_argv(recipe, "zero1", run, "seed=1234", "train.steps=8")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "global_step4 holds a run of a different recipe (seed differ" in err[0], err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_changed_optimizer_values_apply_from_the_first_resumed_step(resumed, strategy):
    from dstrain.recipe_file import load_recipe
    from dstrain.train.engine.schedule import lr_at

    recipe_file, _, results = resumed
    run, *ranks = results[strategy]
    new = load_recipe(recipe_file, CHANGED)
    lr = lr_at(2, 4, new.optim, new.schedule)
    assert lr == pytest.approx(7e-5)  # the decay of the new linear schedule, a third of the way down
    for code, seen in ranks:
        assert code == 0
        assert [g.pop("lr") for g in seen["groups"]] == pytest.approx([lr, lr], rel=1e-12)
        assert seen["groups"] == [{"weight_decay": wd, "betas": [0.8, 0.9], "eps": 1e-6} for wd in (0.05, 0.0)]
        assert seen["base_lrs"] == [1e-4, 1e-4]
        assert seen["engine_clip"] == 0.25 and all(clip == 0.25 for clip in seen["clips"])
        assert strategy == "zero0" or seen["clips"]  # ZeRO-1/2/3 (also under pipeline and TP) clip in the wrapper
    logged = [r["lr"] for r in read_metrics(run) if "split" not in r]
    np.testing.assert_allclose(logged[2:], [lr_at(s, 4, new.optim, new.schedule) for s in (2, 3)], rtol=1e-12)


def test_resume_reports_what_changed(resumed, capfd):
    run, *_ = resumed[2]["zero1"]
    (event,) = read_events(run)
    assert event["step"] == 2 and event["tag"] == "global_step2"
    assert event["changed"]["optim.lr"] == [3e-3, 1e-4] and event["changed"]["schedule.kind"] == ["cosine", "linear"]
    assert event["changed"]["optim.betas"] == [[0.9, 0.95], [0.8, 0.9]]
    assert set(event["changed"]) == {c.split("=")[0] for c in CHANGED}


def test_an_extended_run_follows_the_longer_schedule(resumed):
    """4 steps extended to 8: every logged lr is the 8-step schedule's, as an uninterrupted 8-step run logs."""
    from dstrain.recipe_file import load_recipe
    from dstrain.train.engine.schedule import lr_at

    recipe_file, _, results = resumed
    run, *ranks = results["extended"]
    longer = load_recipe(recipe_file, ["train.steps=8"])
    logged = [r["lr"] for r in read_metrics(run) if "split" not in r]
    assert len(logged) == 8 and all(code == 0 for code, _ in ranks)
    np.testing.assert_allclose(
        logged[4:], [lr_at(s, 8, longer.optim, longer.schedule) for s in range(4, 8)], rtol=1e-12
    )


def test_activation_checkpointing_may_change_on_resume(resumed):
    """Switched on in the ds_config at step 2: accepted, applied to every block, and the losses of steps 3 and 4
    are those of the run that never had it (recomputation changes memory, not the math)."""
    _, base, results = resumed
    run, *ranks = results["checkpointing"]
    for code, calls in ranks:
        assert code == 0 and calls == 2 * 2  # 2 blocks x 2 steps (evaluation runs no checkpointing)
    assert train_losses(run) == train_losses(base["zero1"])


def test_estimate_and_the_model_take_activation_checkpointing_from_the_ds_config(tmp_path, corpus):
    """The ds_config's section turns it on for the estimate and the model."""
    from dstrain.plan.memory import estimate
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_model

    recipe_file = small_recipe(tmp_path, corpus)
    recipe = load_recipe(recipe_file)
    saved = {}
    for name, section in [("off", None), ("on", {"partition_activations": False})]:
        config = ds_config(tmp_path, "zero1", **({"activation_checkpointing": section} if section else {}))
        strategy = resolve(recipe, recipe_file, load_ds_config(config), config, 2)
        saved[name] = next(p.backward for p in estimate(recipe, strategy, 1, 2).parts if p.name == "saved for backward")
        assert (build_model(recipe, strategy).checkpoint_fn is not None) == (name == "on")
    assert saved["on"] < 0.8 * saved["off"]
