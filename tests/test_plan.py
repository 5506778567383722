"""dstrain plan: the layouts it keeps are the ones dstrain.train accepts and that fit; what it writes trains as is;
the time model's pieces behave as stated (dstrain.plan.time_model). Bytes per collective: test_plan_traffic.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dstrain.commands.cli import main as cli
from dstrain.plan.layouts import Layout, plan
from dstrain.plan.memory import estimate, estimate_file
from dstrain.plan.param_counts import count_params
from dstrain.plan.time_model import DEVICES, Cluster, predict
from dstrain.plan.traffic import WIRE
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import AUTO, load_ds_config, resolve

from ranks import run_ranks
from train_helpers import ROOT, small_recipe, train, train_losses

GPT2 = ROOT / "recipes" / "gpt2-125m.yaml"
TINY_MOE = ROOT / "recipes" / "tiny-moe.yaml"
H100 = DEVICES["h100-sxm"]


def test_plan_writes_a_config_that_resolves_fits_and_leaves_the_recipe_its_fields(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli(["plan", "--recipe", str(GPT2), "--nodes", "1", "--gpus-per-node", "8", "--out", str(out), "--top", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fastest first" in printed and f"wrote {out}" in printed
    config = load_ds_config(out)
    for key in ("train_batch_size", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == AUTO
    assert set(config["optimizer"]["params"].values()) == {AUTO}
    recipe = load_recipe(GPT2)
    resolve(recipe, GPT2, config, out, 8, check_device=False)  # DeepSpeed's parser included
    assert estimate_file(recipe, out, 1, 8, H100.memory_gib).fits


def test_plan_keeps_only_layouts_dstrain_accepts_for_a_moe_recipe():
    """tiny-moe: resolve refuses ZeRO-3, TP, PP and SP with model.moe; none is planned. Activation checkpointing
    is (the router losses keep their gradient through the recompute: model/moe.py)."""
    recipe = load_recipe(TINY_MOE, ["model.vocab_size=4096"])
    kept, fitting = plan(recipe, Cluster(H100, 1, 8), "bf16", top=1000)
    assert fitting == len(kept) > 0
    assert {p.layout.ep for p in kept} > {1}  # expert parallelism is weighed
    assert {p.layout.checkpointing for p in kept} == {False, True}
    for p in kept:
        layout = p.layout
        assert layout.zero < 3 and layout.tp == layout.pp == layout.sp == 1, layout


def test_plan_drops_layouts_that_do_not_fit():
    """llama-7b on 8 devices of 40 GiB: ZeRO-1 without model parallelism or offload needs ~64 GB of model states
    (bf16 weights, BF16_Optimizer's whole fp32 gradient buffer, the optimizer's eighth); it is not planned."""
    recipe_file = ROOT / "recipes" / "llama-7b.yaml"
    recipe = load_recipe(recipe_file)
    small = dataclasses.replace(H100, memory_gib=40)
    kept, _ = plan(recipe, Cluster(small, 1, 8), "bf16", top=200)
    assert kept
    for p in kept:
        assert p.estimate.peak("device") + p.estimate.reserve <= 40 * 2**30
    zero1 = _strategy(recipe, Layout(zero=1, micro=1), 8)
    assert not estimate(recipe, zero1, 1, 8, 40).fits
    assert all(p.layout != Layout(zero=1, micro=1) for p in kept)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--nodes", "0"], "--nodes 0"),
        (["--device-memory", "-1"], "--device-memory -1"),
        (["--calibrate", "--device", "h100-sxm"], "--calibrate"),
        (["--top", "0"], "--top 0"),
    ],
)
def test_plan_refuses_bad_arguments_in_one_line(argv, words, capsys):
    assert cli(["plan", "--recipe", str(GPT2), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_sizing_a_recipe_whose_data_is_not_prepared_names_the_override_that_does_without(tmp_path, capsys, command):
    recipe = small_recipe(tmp_path, tmp_path / "not-prepared")
    argv = [command, "--recipe", str(recipe)]
    if command == "estimate":
        argv += ["--deepspeed_config", str(ROOT / "ds_configs" / "zero1.json")]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest" in err[0], err
    assert err[0].endswith(f"; to {command} without the data, pass model.vocab_size=<size>"), err


def test_plan_never_overwrites_a_file(tmp_path, capsys):
    out = tmp_path / "mine.json"
    out.write_text("{}")
    assert cli(["plan", "--recipe", str(GPT2), "--out", str(out)]) == 2
    assert out.read_text() == "{}"
    assert "exists" in capsys.readouterr().err


def _strategy(recipe, layout: Layout, world: int):
    return resolve(recipe, "r.yaml", layout.ds_config("bf16", False), "c.json", world, check_device=False)


def test_time_model_compute_checkpointing_and_bubble():
    recipe = load_recipe(GPT2)
    cluster = Cluster(H100, 1, 8)
    base = _strategy(recipe, Layout(zero=1, micro=8), 8)
    counts = count_params(recipe.model)
    plain = predict(recipe, base, counts, cluster)
    ckpt = predict(recipe, _strategy(recipe, Layout(zero=1, micro=8, checkpointing=True), 8), counts, cluster)
    assert ckpt.compute_s == pytest.approx(plain.compute_s * 4 / 3)
    bigger = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, global_batch=1024))
    doubled = predict(bigger, _strategy(bigger, Layout(zero=1, micro=8), 8), counts, cluster)
    assert doubled.compute_s == pytest.approx(2 * plain.compute_s)
    piped = _strategy(recipe, Layout(zero=1, micro=8, pp=2), 8)
    pp = predict(recipe, piped, count_params(recipe.model, pp=2), cluster)
    assert pp.bubble_s == pytest.approx(pp.compute_s * (2 - 1) / piped.grad_accum)


def test_time_model_groups_take_the_bandwidth_of_the_links_they_cross():
    recipe = load_recipe(GPT2)
    strategy = _strategy(recipe, Layout(zero=1, micro=4, tp=2), 16)
    two_nodes = Cluster(H100, 2, 8)
    assert two_nodes.bandwidth("tp", strategy) == H100.intra_node_gbps * 1e9 / 8
    assert two_nodes.bandwidth("dp", strategy) == H100.inter_node_gbps * 1e9 / 8
    assert Cluster(H100, 1, 16).bandwidth("dp", strategy) == H100.intra_node_gbps * 1e9 / 8
    assert WIRE["all_reduce"](8) == pytest.approx(2 * 7 / 8)  # a ring all-reduce moves 2(n-1)/n of the tensor


@pytest.mark.distributed
def test_config_written_by_plan_trains_as_written(tmp_path, corpus):
    """The fastest layout for this machine (calibrated), written by `dstrain plan`, trains 2 steps on 2 CPU ranks."""
    recipe = small_recipe(tmp_path, corpus, train={"steps": 2})
    out = tmp_path / "plan.json"
    assert (
        cli(["plan", "--recipe", str(recipe), "--calibrate", "--nodes", "1", "--gpus-per-node", "2", "--out", str(out)])
        == 0
    )
    written = out.read_text()
    run = tmp_path / "run"
    assert run_ranks(2, train, ["--recipe", str(recipe), "--deepspeed_config", str(out), f"run_dir={run}"]) == [0, 0]
    assert len(train_losses(run)) == 2
    assert out.read_text() == written and json.loads(written)["train_batch_size"] == AUTO
    assert not Path(f"{out}.tmp").exists()


def test_compare_plan_refuses_configs_beside_plan(capsys):
    argv = ["compare", "--recipe", str(GPT2), "--plan", "2", "--deepspeed_configs", "ds_configs/zero1.json"]
    assert cli([*argv, "--out", "x"]) == 2
    assert "--plan K" in capsys.readouterr().err


def _steps(run: Path, rates: list[float]) -> None:
    run.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": 1.0, "tokens_per_s": r}) for i, r in enumerate(rates)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_compare_plan_table_sets_predicted_beside_measured_and_judges_by_the_runs_spread(tmp_path):
    from dstrain.commands.compare_plan import prediction_lines

    _steps(tmp_path / "a", [50, 100, 100, 95, 105, 100])  # 1 s per step of 100 tokens (the first is start-up)
    _steps(tmp_path / "b", [50, 97, 98, 99, 98, 97])  # 1.02 s: within a's spread
    table = "\n".join(prediction_lines(tmp_path, {"a": 0.8, "b": 0.9}, 100))
    assert "| a | 0.800 | 1.000 | 1.25 |" in table
    assert "Fastest predicted `a` is the fastest measured `a`" in table
    table = "\n".join(prediction_lines(tmp_path, {"b": 0.8, "a": 0.9}, 100))
    assert "`b` within noise of the fastest measured `a`" in table


def test_time_model_hides_zero3_collectives_only_where_the_device_overlaps_them():
    recipe = load_recipe(GPT2)
    strategy = _strategy(recipe, Layout(zero=3, micro=8), 16)
    counts = count_params(recipe.model, persistence_threshold=100_000)
    streams = predict(recipe, strategy, counts, Cluster(H100, 2, 8))
    inline = predict(recipe, strategy, counts, Cluster(dataclasses.replace(H100, overlaps_communication=False), 2, 8))
    assert "all_gather_into_tensor (dp)" not in streams.comm_s
    assert inline.comm_s["all_gather_into_tensor (dp)"] > 0 and inline.step_s > streams.step_s
