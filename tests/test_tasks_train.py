"""Downstream tasks inside training: a tiny run logs the same task accuracies at each evaluation under every
strategy, and `dstrain eval --tasks` on its checkpoint and lm-evaluation-harness on its export give the same
numbers (fp32, 2 gloo ranks)."""

from __future__ import annotations

import argparse

import pytest
from task_fixtures import write_task_file

import train_helpers
from ranks import run_ranks
from train_helpers import ds_config, read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

FORMATS = ("hellaswag", "arc", "piqa", "winogrande", "lambada")
STRATEGIES = ("zero1", "zero3", "pp2_zero1", "tp2_zero1", "sp2_zero1", "zero3_chunked", "pp2_chunked")
CHUNKED = {"zero3_chunked": "zero3", "pp2_chunked": "pp2_zero1"}  # the loss, and so the scorer's head, in 4 chunks
LIMIT = 6  # items per task: 22 requests of hellaswag/arc, 12 of piqa/winogrande, 6 of lambada


def run_all(calls: list) -> list:
    return [(globals().get(name) or getattr(train_helpers, name))(*args) for name, args in calls]


def eval_tasks(argv: list[str]) -> dict:
    """Rank target: `dstrain eval ... --tasks`."""
    from dstrain.commands import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return evaluate.evaluate_tasks(parser.parse_args([str(a) for a in argv]))


def pipeline_eval_total_loss() -> str:
    """What PipelineEngine.eval_batch does when its loss changes shape from one call to the next (a scalar loss,
    then the scorer's (B, 2) rows)."""
    import deepspeed
    import torch

    from dstrain.model.config import GPTConfig
    from dstrain.model.pipe import build_pipeline
    from dstrain.tasks.scoring import continuation_stats
    from dstrain.train.process import distributed

    distributed.init()
    config = GPTConfig(flavour="llama", vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9}
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    model = build_pipeline(config, seed=0, stages=1)  # two one-stage pipelines: no collective to hang on
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    tokens = torch.randint(0, 64, (1, 9))
    batch = (tokens[:, :-1], tokens[:, 1:])
    engine.eval_batch(iter([batch]), num_micro_batches=1, reduce_output=None, bcast_loss=False)
    engine.module.loss_fn = continuation_stats
    try:
        engine.eval_batch(iter([batch]), num_micro_batches=1, reduce_output=None, bcast_loss=False)
    except RuntimeError:
        return "RuntimeError"
    return "ok"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """4 steps, evaluated at steps 2 and 4, under each strategy (and an MoE model under expert parallelism);
    then `dstrain eval --tasks` on each run's last checkpoint, on 2 ranks."""
    tmp = tmp_path_factory.mktemp("tasks_train")
    tasks = [{"name": f, "format": f, "path": str(write_task_file(tmp, f, 8)), "limit": LIMIT} for f in FORMATS]
    train = {"steps": 4, "eval_interval": 2, "tasks": tasks}
    recipe = small_recipe(tmp, corpus, name="dense", train=train)
    moe = small_recipe(tmp, corpus, name="moe", train=train, model={"moe": {"num_experts": 4, "top_k": 2}})
    dirs = {name: tmp / name for name in [*STRATEGIES, "ep2_zero1"]}
    configs = {name: ds_config(tmp, CHUNKED[name], tiling={"loss": 4}) if name in CHUNKED else name for name in dirs}
    calls = [("train", [train_argv(recipe, configs[name], dirs[name])]) for name in STRATEGIES]
    calls.append(("train", [train_argv(moe, "ep2_zero1", dirs["ep2_zero1"])]))
    calls += [("eval_tasks", [[run, "--tasks"]]) for run in dirs.values()]
    calls.append(("pipeline_eval_total_loss", []))
    results = run_ranks(2, run_all, calls)
    assert results[0][: len(dirs)] == [0] * len(dirs)
    return dirs, dict(zip(dirs, results[0][len(dirs) : 2 * len(dirs)])), [rank[-1] for rank in results]


def task_numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("task/")}


def evals(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("split") == "valid"]


@pytest.mark.parametrize("strategy", [*STRATEGIES, "ep2_zero1"])
def test_tasks_are_logged_at_each_evaluation(runs, strategy):
    records = evals(runs[0][strategy])
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        numbers = task_numbers(record)
        assert {numbers[f"task/{f}/samples"] for f in FORMATS} == {LIMIT}
        assert {k.rsplit("/", 1)[1] for k in numbers if k.startswith("task/lambada/")} == {"acc", "samples"}
        assert all(0 <= numbers[f"task/{f}/acc"] <= 1 for f in FORMATS)
        assert 0 < record["tasks_s"] <= record["duration_s"]


def test_every_strategy_logs_the_same_accuracies(runs):
    """Same math, same items: the accuracies at each evaluation agree exactly across ZeRO-1/3, PP2, TP2 and SP2, and
    with the loss and the scorer's head chunked under ZeRO-3 and on the pipeline's last stage."""
    reference = [task_numbers(r) for r in evals(runs[0]["zero1"])]
    assert len(reference) == 2 and all(reference)
    for strategy in STRATEGIES[1:]:
        assert [task_numbers(r) for r in evals(runs[0][strategy])] == reference, strategy


@pytest.mark.parametrize("strategy", [*STRATEGIES, "ep2_zero1"])
def test_dstrain_eval_gives_the_loops_numbers(runs, strategy):
    """`dstrain eval RUN --tasks` on the last checkpoint: the numbers of the loop's last evaluation, exactly."""
    dirs, evaluated, _ = runs
    assert task_numbers(evaluated[strategy]) == task_numbers(evals(dirs[strategy])[-1])


@pytest.mark.deepspeed_defect(
    "PipelineEngine.eval_batch adds every output into total_loss, which only train_batch resets "
    "(train/step/forward.py::ModelForward._pipe_score)"
)
def test_deepspeed_pipeline_eval_total_loss_defect(runs):
    """DeepSpeed 0.19.8: a second eval_batch whose loss has another shape fails adding it to the first's total;
    ModelForward._pipe_score empties total_loss around each call. If this fails, drop that line."""
    assert runs[2] == ["RuntimeError"] * 2


@pytest.mark.harness
def test_lm_eval_on_the_export_gives_the_loops_numbers(runs, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra .[harness]")
    from dstrain.commands.cli import main
    from dstrain.recipe_file import load_recipe
    from dstrain.run_dir import RunDir
    from dstrain.tasks.harness import run_harness

    run = runs[0]["zero1"]
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    tasks = load_recipe(RunDir(run).recipe).train.tasks
    theirs = run_harness(str(tmp_path / "hf"), tasks, batch_size=4, device="cpu")
    assert {k: v for k, v in theirs.items() if k != "items"} == task_numbers(evals(run)[-1])
