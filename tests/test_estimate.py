"""dstrain estimate: the published formulas (the ZeRO paper), DeepSpeed's estimators, the levers at size, and refusals
(what it measures against: tests/test_estimate_measured.py)."""

import json
import math
import time

import pytest

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.counts import num_params
from dstrain.plan.memory import estimate, estimate_file
from dstrain.plan.memory_parts import GIB
from dstrain.plan.param_counts import count_params
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

from train_helpers import ROOT

LLAMA_7B = ROOT / "recipes" / "llama-7b.yaml"


# --- the published formulas, DeepSpeed's estimators, and refusals -------------------------------------------


def test_params_counted_on_the_meta_device_in_seconds():
    llama_70b = GPTConfig(
        flavour="llama",
        vocab_size=32000,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        d_model=8192,
        d_ff=28672,
        max_seq_len=4096,
    )
    start = time.perf_counter()
    counts = count_params(llama_70b)
    assert time.perf_counter() - start < 30  # no memory is allocated for 69 B parameters
    assert counts.total == num_params(llama_70b) == 68_976_648_192
    assert counts.largest_layer == 32000 * 8192  # the embedding (untied head of the same size)


def test_llama_7b_zero3_on_8_gpus_against_the_zero_paper():
    recipe = load_recipe(LLAMA_7B)
    est = estimate_file(recipe, ROOT / "ds_configs" / "zero3_bf16.json", nodes=1, gpus_per_node=8)
    psi, n = num_params(recipe.model), 8
    assert est.params_total == psi == 6_738_415_616 and est.dp_size == n
    step = {p.name: p.step for p in est.parts}
    # ZeRO paper, stage 3 (P_os+g+p): (2 + 2 + K)·Ψ/N_d with K = 12 for mixed-precision Adam.
    paper = {"parameters": 2, "gradients": 2, "optimizer states": 12}
    assert step["parameters (bf16), 1/8 partition"] == paper["parameters"] * psi / n
    assert step["fp32 master weights"] + step["Adam moments (fp32)"] == paper["optimizer states"] * psi / n
    # Gradients differ from the paper's on purpose: dstrain sums bf16 gradients in fp32 (a 4-byte partition), and
    # DeepSpeed builds an fp32 copy of each sub-group (here the whole partition: Ψ/N < sub_group_size) to step it.
    assert step["gradients (fp32), 1/8 partition"] == 2 * paper["gradients"] * psi / n
    assert step["gradients (fp32 copy for the optimizer)"] == 4 * psi / n
    assert est.model_states() == 22 * psi / n
    # DeepSpeed's own estimator: 18Ψ/N plus the largest layer (param + grad, 16-bit); it omits the 16-bit gradients.
    ref = est.deepspeed_reference
    assert ref["device"] == int(18 * psi / n) + 4 * 32000 * 4096
    assert est.fits and 20 * GIB < est.peak() < 40 * GIB  # 15.7 GiB model states, activations with checkpointing


def test_zero2_bf16_against_deepspeeds_estimator():
    """DeepSpeed's estimator assumes 16-bit gradient partitions plus an fp32 copy at the step (18Ψ/N); with the
    fp32 accumulation dstrain requires, the optimizer steps the fp32 partition itself (16Ψ/N, measured on 2 ranks
    by test_model_states_match_what_two_ranks_hold)."""
    recipe = load_recipe(LLAMA_7B)
    for nodes, gpus in [(1, 8), (4, 8)]:
        est = estimate_file(recipe, ROOT / "ds_configs" / "zero2_bf16.json", nodes, gpus)
        psi, n = est.params_total, nodes * gpus
        assert est.model_states() == 2 * psi + 16 * math.ceil(psi / n)
        assert est.deepspeed_reference["device"] == 2 * psi + int(18 * psi / n)


def test_zero3_steps_one_sub_group_at_a_time(tmp_path):
    """ZeRO-3 builds the fp32 gradient copy of one sub-group at a time: a 69 B llama on 8 GPUs holds at most
    4 x sub_group_size bytes of it (3.7 GiB at the default 1e9), not 4Ψ/N (32 GiB)."""
    recipe = load_recipe(
        LLAMA_7B, ["model.n_layer=80", "model.d_model=8192", "model.n_head=64", "model.n_kv_head=8", "model.d_ff=28672"]
    )
    config = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    for sub_group in (None, 10**8):
        if sub_group:
            config["zero_optimization"]["sub_group_size"] = sub_group
        path = tmp_path / f"zero3-{sub_group}.json"
        path.write_text(json.dumps(config))
        est = estimate_file(recipe, path, nodes=1, gpus_per_node=8)
        assert est.params_total > 8 * 10**9 * 8  # Ψ/N above the default sub-group
        copy = next(p for p in est.parts if p.name == "gradients (fp32 copy for the optimizer)")
        assert copy.step == 4 * (sub_group or 10**9)


def test_too_big_does_not_fit_and_the_cheapest_fitting_config_is_named(capsys):
    from dstrain.commands.cli import main

    argv = [
        "estimate",
        "--recipe",
        str(LLAMA_7B),
        "--deepspeed_config",
        str(ROOT / "ds_configs" / "zero1_bf16.json"),
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--configs-dir",
        str(ROOT / "ds_configs"),
        "--json",
    ]
    assert main(argv) == 1  # does not fit: a script can stop before sbatch
    report = json.loads(capsys.readouterr().out)
    psi = report["params_total"]
    assert report["fits"] is False and report["device_peak"] > 80 * GIB
    # bf16 weights and gradients, BF16_Optimizer's whole fp32 accumulation buffer, fp32 master and moments in 8ths
    assert report["model_states"] == 8 * psi + 12 * math.ceil(psi / 8)
    # The first that fits, same precision: ZeRO-3 bf16, whose ds_config recomputes activations (activation
    # checkpointing is a strategy); ZeRO-1 and 2 bf16 would fit the model states, not 4096-token activations.
    assert report["cheapest_fitting"].endswith("zero3_bf16.json")
    assert main(argv[:-1]) == 1
    table = capsys.readouterr().out
    assert "does not fit" in table and "zero3_bf16.json" in table and "Adam moments" in table
    # the same recipe fits 80 GiB at ZeRO-3, and an 18 GiB device only with offload
    assert main([*argv[:4], str(ROOT / "ds_configs" / "zero3_bf16.json"), *argv[5:]]) == 0
    capsys.readouterr()
    assert main([*argv, "--device-memory", "18"]) == 1
    assert json.loads(capsys.readouterr().out)["cheapest_fitting"].endswith("offload_nvme_bf16.json")


def test_bad_input_is_one_line(capsys, tmp_path):
    from dstrain.commands.cli import main

    base = ["estimate", "--recipe", str(LLAMA_7B), "--deepspeed_config"]
    assert main([*base, str(ROOT / "ds_configs" / "zero3_bf16.json"), "--nodes", "0"]) == 2
    assert "--nodes 0 --gpus-per-node 8: both must be at least 1" in capsys.readouterr().err
    bad = tmp_path / "micro3.json"
    bad.write_text(
        json.dumps(
            {**json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text()), "train_micro_batch_size_per_gpu": 3}
        )
    )
    assert main([*base, str(bad), "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "micro3.json: train_micro_batch_size_per_gpu=3" in err[0]
        and "valid micro-batch sizes" in err[0]
    )
    with pytest.raises(DstrainError, match="offload_.* needs ZeRO stage 1, 2 or 3"):
        cfg = tmp_path / "zero0_offload.json"
        cfg.write_text(
            json.dumps(
                {
                    **json.loads((ROOT / "ds_configs" / "zero0.json").read_text()),
                    "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
                }
            )
        )
        estimate_file(load_recipe(LLAMA_7B), cfg, 1, 8)


def test_pipeline_stages_hold_whole_layers_and_the_tied_head():
    """gpt2-125m, tied: the stages DeepSpeed's partition_balanced cuts hold whole blocks, and the last one a second
    copy of the embedding as the head (pp2: 6 blocks, the final norm and the head = 81.9 M, not half the model's
    62.2 M)."""
    recipe = load_recipe(ROOT / "recipes" / "gpt2-125m.yaml")
    import torch

    from dstrain.model.gpt import GPT

    with torch.device("meta"):
        named = {name: p.numel() for name, p in GPT(recipe.model).named_parameters()}
    embed = sum(n for name, n in named.items() if name.startswith("embed."))
    block = sum(n for name, n in named.items() if name.startswith("blocks.0."))
    norm = sum(n for name, n in named.items() if name.startswith("norm."))
    assert recipe.model.tied and recipe.model.n_layer == 12
    assert count_params(recipe.model, pp=2).per_rank == 6 * block + norm + embed == 81_948_672  # the last stage
    assert count_params(recipe.model, pp=4).per_rank == 6 * block == 42_527_232  # embedding, 6, 6, norm + head
    assert count_params(recipe.model, pp=4, partition_method="uniform").per_rank == embed + 3 * block


def test_sequence_parallel_divides_activations_and_partitions_over_every_rank():
    """Ulysses on 8 GPUs: each rank holds 1/8 of every sample (activations, logits) and ZeRO partitions the model
    states over all 8 ranks (DeepSpeed's sequence-data-parallel group), though there is one data-parallel replica."""
    recipe_file = ROOT / "recipes" / "llama-1b-32k.yaml"
    recipe = load_recipe(recipe_file)
    plain = load_ds_config(ROOT / "ds_configs" / "zero3_bf16.json")
    plain["train_micro_batch_size_per_gpu"] = 1  # the SP config's micro-batch: the same tokens per forward
    plain["tiling"] = {"loss": 1}  # the whole loss on both (the default chunks 32k tokens' logits, not 4k's)
    base = estimate(recipe, resolve(recipe, recipe_file, plain, "zero3_bf16", 8, check_device=False), 1, 8)
    sp = estimate_file(recipe, ROOT / "ds_configs" / "sp8_zero3_bf16.json", nodes=1, gpus_per_node=8)
    assert (
        sp.parts
        == estimate(
            recipe,
            resolve(
                recipe,
                recipe_file,
                {**load_ds_config(ROOT / "ds_configs" / "sp8_zero3_bf16.json"), "tiling": {"loss": 1}},
                "sp8_zero3_bf16.json",
                8,
                check_device=False,
            ),
            1,
            8,
        ).parts
    )  # 4096 tokens a rank: "auto" keeps the loss whole
    assert (sp.dp_size, sp.sp_size, base.dp_size) == (1, 8, 8)
    assert sp.model_states() == base.model_states()
    act = {p.name: (p.backward, q.backward) for p, q in zip(sp.parts, base.parts) if p.group == "activations"}
    saved, base_saved = act["saved for backward"]
    assert act["logits gradient (backward start)"][0] * 8 == act["logits gradient (backward start)"][1]
    assert abs(saved * 8 / base_saved - 1) < 0.02  # RoPE tables and ids are per slice too; nothing else grows
    exchange = next(p for p in sp.parts if p.name == "Ulysses all-to-all (q, k, v)")
    assert exchange.backward == 2 * 2 * 32768 // 8 * (2048 + 2 * 8 * 64)


def test_llama_1b_32k_fits_8_gpus_only_with_sequence_parallelism_or_the_chunked_loss():
    """The long-context recipe: sp8_zero3_bf16 fits one node of 8 x 80 GiB; with the loss whole no shipped ds_config
    without SP does, and with the default chunked loss the ZeRO-3 configs with activation checkpointing (zero3_bf16,
    zero3_offload_nvme_bf16) do too: 32,768 tokens' whole logits alone would take 12·T·V = 11.7 GiB."""
    recipe_file = ROOT / "recipes" / "llama-1b-32k.yaml"
    recipe = load_recipe(recipe_file)
    sp = estimate_file(recipe, ROOT / "ds_configs" / "sp8_zero3_bf16.json", nodes=1, gpus_per_node=8)
    assert sp.fits and sp.peak() < 12 * GIB
    fitting = []
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        ds = json.loads(path.read_text())
        if ds.get("sequence_parallel_size", 1) > 1 or ds.get("fp16", {}).get("enabled"):
            continue
        try:
            est = estimate_file(recipe, path, nodes=1, gpus_per_node=8)
            whole = resolve(recipe, recipe_file, {**ds, "tiling": {"loss": 1}}, path, 8, check_device=False)
        except DstrainError:  # not valid for 8 ranks of this recipe
            continue
        assert not estimate(recipe, whole, 1, 8).fits, path.name
        fitting += [path.name] if est.fits else []
    assert fitting == ["zero3_bf16.json", "zero3_offload_nvme_bf16.json"]


def test_nvme_offload_keeps_model_states_on_disk_and_pinned_buffers_on_the_host(capsys):
    """ZeRO-Infinity, llama-7b on 8 ranks: the bf16 parameter partition, fp32 master, Adam moments and fp32 gradients
    on disk (DeepSpeed swaps the gradients of each swapped sub-group too), the host holding only the pinned swap
    buffers the ds_config sizes, and no optimizer state on the device."""
    from dstrain.commands.cli import main

    config = ROOT / "ds_configs" / "zero3_offload_nvme_bf16.json"
    est = estimate_file(load_recipe(LLAMA_7B), config, 1, 8)
    part = math.ceil(est.params_per_rank / 8)
    assert est.peak("nvme") == (2 + 4 + 8 + 4) * part
    assert est.peak("cpu") == 5 * 10**8 * 2 + 4 * min(10**9, part) * 4  # buffer_count x buffer_size (bf16) + optimizer
    assert est.total("device", "step", ("optimizer states",)) == 0
    assert main(["estimate", "--recipe", str(LLAMA_7B), "--deepspeed_config", str(config), "--nodes", "1"]) == 0
    table = capsys.readouterr().out
    assert "total nvme" in table and "NVMe optimizer swap buffers (pinned)" in table and "NVMe per node" in table


@pytest.mark.launcher
def test_the_command_opens_with_its_own_lines(tmp_path):
    """As a user runs it, without a GPU: no "Setting accelerator to CPU" from DeepSpeed before (or in) the estimate.
    On a machine with a GPU DeepSpeed has no such line to print, and only the estimate's first line is checked."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed detects, as for a user
    result = subprocess.run(
        [sys.executable, "-m", "dstrain", "estimate", "--recipe", str(ROOT / "recipes/tiny.yaml")]
        + ["--deepspeed_config", str(ROOT / "ds_configs/zero1.json"), "--gpus-per-node", "2", "model.vocab_size=512"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Setting accelerator" not in result.stdout + result.stderr
    assert result.stdout.startswith("tiny under "), result.stdout.splitlines()[:2]
