"""`dstrain estimate` and `dstrain plan` with adapters (dstrain.plan.adapter_costs): the frozen base with no gradient
and no optimizer state, the adapters' state, the NF4 base's bytes; the planner's replicated base against a sharded
one; the adapter recipes' planned layouts."""

import json
import math
from dataclasses import replace

import pytest
import yaml

from dstrain.adapters.config import adapter_params
from dstrain.adapters.qlora_checks import packed_bytes
from dstrain.model.counts import flops_per_token, num_params
from dstrain.plan.memory import estimate_file
from dstrain.plan.memory_parts import GIB
from dstrain.recipe_file import load_recipe

from train_helpers import ROOT

RECIPES = {  # recipe: (nodes, GPUs per node, device GiB): as their first comments plan them
    "sft-lora-llama3.1-8b": (1, 1, 80.0),
    "sft-qlora-llama3.1-70b": (1, 2, 34.0),
    "dpo-lora-qwen3-8b": (1, 8, 80.0),
}
ANCHOR_BYTES = 36.6e9  # PEFT's DeepSpeed guide: QLoRA of a 70B Llama with ZeRO-3 on 2 GPUs, per GPU


def parts_by_name(est) -> dict:
    return {p.name: p for p in est.parts}


def test_llama_8b_lora_counts_peft_trainable_parameters_and_no_state_for_the_base():
    """PEFT prints 41,943,040 trainable parameters for Llama-3.1-8B at r=16 on all linear layers: 32 blocks x
    16 x ((4096 + 4096) + (4096 + 1024) x 2 + (4096 + 4096) + (4096 + 14336) x 2 + (14336 + 4096))."""
    path = ROOT / "recipes" / "sft-lora-llama3.1-8b.yaml"
    recipe = load_recipe(path)
    est = estimate_file(recipe, ROOT / "ds_configs" / "zero2_bf16.json", 1, 1)
    assert est.trainable_params == 41_943_040 == adapter_params(recipe.lora, recipe.model)
    total = num_params(recipe.model)
    parts = parts_by_name(est)
    base = parts["frozen base (bf16): no gradient, no optimizer state"]
    assert base.backward == base.step == 2 * total  # every parameter of the model, in bf16, nothing else
    assert parts["Adam moments (fp32)"].step == 8 * est.trainable_params
    assert parts["fp32 master weights"].step == 4 * est.trainable_params
    gradients = sum(max(p.backward, p.step) for p in est.parts if p.group == "gradients")
    assert gradients == 4 * est.trainable_params  # ZeRO-2 bf16: the fp32 gradient partition, of the adapters only
    # the chunked loss forms no gradient for the frozen head: (4 + 2)·V·d bytes fewer than the full model's
    full = estimate_file(replace(recipe, lora=None), ROOT / "ds_configs" / "zero2_bf16.json", 1, 1)
    chunked = [name for name in parts if name.startswith("chunked loss")]
    assert len(chunked) == 1
    freed = parts_by_name(full)[chunked[0]].backward - parts[chunked[0]].backward
    assert freed == 6 * recipe.model.vocab_size * recipe.model.d_model


def test_qlora_70b_counts_the_nf4_bytes_and_shards_them_under_zero3():
    path = ROOT / "recipes" / "sft-qlora-llama3.1-70b.yaml"
    recipe = load_recipe(path)
    m = recipe.model
    projections = [
        m.d_model * m.d_model,
        m.d_model * 1024,
        m.d_model * 1024,
        m.d_model * m.d_model,
        *[m.d_model * m.d_ff] * 3,
    ]
    nf4 = m.n_layer * sum(packed_bytes(n) for n in projections)
    # 4 bits, an int8 scale per 64 weights, an fp32 factor per 256 scales (and 68 bytes of constants a matrix)
    assert nf4 == m.n_layer * (sum(projections) * (0.5 + 1 / 64 + 4 / (64 * 256)) + 7 * 68)
    for config, share in (("zero2_bf16.json", 1), ("zero3_bf16.json", 2)):
        est = estimate_file(recipe, ROOT / "ds_configs" / config, 1, 2)
        held = [p for p in est.parts if p.name.startswith("frozen base, NF4")]
        assert len(held) == 1 and held[0].backward == math.ceil(nf4 / share)
        bf16 = [p for p in est.parts if p.name.startswith("frozen base (bf16)")][0]
        tables = 2 * m.vocab_size * m.d_model + (2 * m.n_layer + 1) * m.d_model  # embeddings, head, norms
        assert bf16.backward == 2 * math.ceil(tables / share)


def test_lora_compute_is_about_two_thirds_of_full_fine_tuning():
    """The frozen matrices' weight gradients are not formed: 4N + 6·adapters + attention against 6N + attention."""
    from dstrain.plan.adapter_costs import lora_flops_per_token

    recipe = load_recipe(ROOT / "recipes" / "sft-lora-llama3.1-8b.yaml")
    full = flops_per_token(recipe.model, recipe.data.seq_len)
    lora, backward = lora_flops_per_token(recipe)
    n = num_params(recipe.model, exclude_embeddings=True)
    assert lora == full - 2 * n + 6 * 41_943_040
    assert 0.66 < lora / full < 0.72  # "LoRA Without Regret": about two thirds (0.713 at 4096 tokens)
    assert 0.5 < backward < 0.55  # half of the matrices' FLOPs, two thirds of attention's (0.530)


def write_recipe(folder, name: str, **model) -> str:
    recipe = {
        "name": name,
        "model": {"flavour": "llama", "vocab_size": 32000, "n_kv_head": 8, **model},
        "data": {"sources": [{"path": str(folder / "no-data")}], "seq_len": 2048},
        "train": {"global_batch": 64, "steps": 10},
        "lora": {"rank": 16, "alpha": 32},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_planner_replicates_a_base_that_fits_and_shards_one_that_does_not(tmp_path):
    """A 1B base fits every GPU whole: ZeRO-1/2 moves only the adapters' gradients, ZeRO-3 fetches the base module
    by module twice a micro-batch, so the replicated base is faster; a 70B base (140 GB in bf16) fits 8 GPUs only
    sharded."""
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import DEVICES, Cluster, layout_counts, traffic_table

    cluster = Cluster(DEVICES["h100-sxm"], 1, 8)
    small = write_recipe(tmp_path, "small", n_layer=16, n_head=32, d_model=2048, d_ff=8192)
    recipe = load_recipe(small)
    found, _ = plan(recipe, cluster, "bf16", top=40)
    assert found[0].layout.zero in (1, 2), found[0].layout.describe()
    sharded = [p for p in found if p.layout.zero == 3]
    assert sharded and sharded[0].prediction.step_s > found[0].prediction.step_s  # it fits, and is slower
    assert "ZeRO-3 module fetches" in sharded[0].prediction.comm_s
    strategy = sharded[0].strategy
    traffic = {t.what: t for t in traffic_table(recipe, strategy, layout_counts(recipe, strategy))}
    frozen, trainable = num_params(recipe.model), sharded[0].estimate.trainable_params
    # the whole base (bf16) gathered at least once a micro-batch; only the adapters' gradients reduced (fp32)
    assert traffic["frozen base"].logged_bytes >= 2 * math.ceil(frozen / 8) * strategy.grad_accum
    assert traffic["gradients into their partitions"].logged_bytes == strategy.grad_accum * trainable * 4
    big = write_recipe(tmp_path, "big", n_layer=80, n_head=64, d_model=8192, d_ff=28672)
    found, _ = plan(load_recipe(big), cluster, "bf16", top=1)
    assert found[0].layout.zero == 3, found[0].layout.describe()


@pytest.mark.parametrize("name", list(RECIPES))
def test_adapter_recipes_ship_the_layout_the_planner_picks(name):
    from dstrain.plan.layouts import plan
    from dstrain.plan.time_model import DEVICES, Cluster

    nodes, gpus, memory = RECIPES[name]
    path = ROOT / "recipes" / f"{name}.yaml"
    shipped_path = ROOT / "ds_configs" / "planned" / f"{name}-{nodes}x{gpus}-h100.json"
    assert shipped_path.name in path.read_text()  # the recipe names its layout
    shipped = json.loads(shipped_path.read_text())
    device = DEVICES["h100-sxm"]
    cluster = Cluster(type(device)(**{**device.__dict__, "memory_gib": memory}), nodes, gpus)
    found, fitting = plan(load_recipe(path), cluster, "bf16", top=1)
    assert fitting > 0 and found[0].ds_config == shipped, found[0].layout.describe()
    peak = found[0].estimate.peak() + found[0].estimate.reserve
    if name == "sft-qlora-llama3.1-70b":
        assert found[0].layout.zero == 3 and peak <= ANCHOR_BYTES  # within PEFT's anchor, per GPU
    assert peak <= memory * GIB


# --- the estimate's adapter terms against what 2 ranks hold (tests/test_estimate_measured.py's measure) -------------

# Not fp32 ZeRO-2: with adapters DeepSpeed 0.19.8 holds one fp32 gradient partition (4Ψ/N) where the estimate, as
# for the full model (where it measures both), counts the partition and its copy for the optimizer: 2x on the
# adapters' gradients (0.08 of 0.16 MB here); the bf16 ZeRO-2 the planner writes is measured instead.
# Not ZeRO-3: there the ranks held more parameter bytes than the estimate's partitions (+76% with LoRA, +15% with
# QLoRA on this model): every block projection was still gathered (ds_status AVAILABLE) after the forward and after
# the backward, with stage3_max_live_parameters at 60,000 of 0.7M too; not yet explained (the full model's ZeRO-3
# matches: tests/test_estimate_measured.py).
ADAPTER_RTOL = 0.01  # measured: at most 0.04% (Adam state of ZeRO-0), the NF4 bytes exact
LORA_CONFIGS = ["zero0", "zero1", "zero1_bf16", "zero2_bf16"]
QLORA_CONFIGS = ["zero1", "zero2_bf16"]


def write_lora_recipe(folder, quantize: bool) -> str:
    """2 llama blocks of width 128 (every projection whole NF4 blocks), rank-8 adapters on every linear layer."""
    recipe = {
        "name": "adapter-estimate-check",
        "seed": 3,
        "model": {"flavour": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 128, "vocab_size": 2048},
        "data": {"sources": [{"path": str(folder / "no-data")}], "seq_len": 32},
        "train": {"global_batch": 16, "steps": 2},
        "lora": {"rank": 8, "alpha": 16, **({"quantize_base": "nf4"} if quantize else {})},
    }
    path = folder / f"recipe-{'qlora' if quantize else 'lora'}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.distributed
@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_adapter_model_states_match_what_two_ranks_hold(tmp_path, quantize):
    from test_estimate_measured import held_bytes

    from ranks import run_ranks

    recipe_file = write_lora_recipe(tmp_path, quantize)
    configs = QLORA_CONFIGS if quantize else LORA_CONFIGS
    measured = run_ranks(2, held_bytes, recipe_file, configs, env={"OMP_NUM_THREADS": "1"})
    recipe = load_recipe(recipe_file)
    print(f"\n{'config':12} {'group':17} {'estimate KB':>12} {'held KB':>10} {'gap':>8}")
    for name, rank0, rank1 in zip(configs, *measured):
        est = estimate_file(recipe, ROOT / "ds_configs" / f"{name}.json", 1, 2, fused_norms=False)
        groups = {
            g: max(sum(getattr(p, ph) for p in est.parts if p.group == g) for ph in ("backward", "step"))
            for g in ("parameters", "gradients", "optimizer states")
        }
        for group, expected in groups.items():
            for held in (rank0, rank1):
                gap = held.get(group, 0) / expected - 1
                assert abs(gap) <= ADAPTER_RTOL, f"{name} {group}: estimate {expected:,} B, held {held.get(group):,} B"
            print(f"{name:12} {group:17} {expected / 1e3:12.1f} {rank0.get(group, 0) / 1e3:10.1f} {gap:+8.2%}")
        # what trains is the adapters alone: their gradients and Adam state are a sliver of the frozen base
        assert groups["optimizer states"] < 0.2 * groups["parameters"]
