"""Mixture of experts on CPU ranks (gloo, fp32): expert parallelism from the ds_config never changes the math
(losses, router losses and pre-clip gradient norms of EP1 and EP2 agree under ZeRO-1 and ZeRO-2, with Mixtral's,
Qwen3-MoE's and Llama 4's routers), nor does activation checkpointing (the router losses keep their gradient through
the recompute), the run resumes exactly, and the checkpoint exports to a MixtralForCausalLM with our logits."""

import json
import math

import pytest
import torch

import train_helpers
from ranks import run_ranks
from train_helpers import ROOT, ds_config, read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

# EP2 computes each expert on the tokens of both ranks in one matmul where EP1 runs two and the all-reduce adds
# them: the same fp32 sums in another order. Measured: agreement to ~1e-7 relative over 10 steps.
RTOL = 1e-5
# Recompute runs the same block on the same inputs: the same sums in the same order (measured: equal, bit for bit)
RECOMPUTE_RTOL = 1e-6
CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False}
MOE = {"num_experts": 4, "top_k": 2}
# Qwen3-MoE's features: q/k norms per head, a decoupled head width, unnormalised top-k weights, a dense first block
QWEN3_MOE = {
    "family": "qwen3_moe",
    "qk_norm": "head",
    "d_head": 32,
    "moe": {**MOE, "norm_topk_prob": False, "dense_layers": [0]},
}
# Llama 4's: top-1, the sigmoid score scaling the chosen expert's input, a shared expert; l2 q/k norm, block 1 NoPE
LLAMA4_MOE = {
    "family": "llama4",
    "qk_norm": "l2",
    "nope_layers": [1],
    "moe": {"num_experts": 4, "top_k": 1, "input_scaling": True, "n_shared_experts": 1},
}


def run_all(calls: list) -> list:
    return [(globals().get(name) or getattr(train_helpers, name))(*args) for name, args in calls]


def shipped_layout_in_fp32(tmp, name: str = "planned/continue-qwen3-30b-a3b-1x8-h100"):
    """The layout shipped with continue-qwen3-30b-a3b (ZeRO-2, experts split, optimizer on the host) on 2 fp32 ranks:
    experts over 2, its micro-batch for the global batch of 8, and activation checkpointing besides."""
    config = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    for key in ("bf16", "data_types", "communication_data_type"):
        config.pop(key)
    config.update(train_micro_batch_size_per_gpu=4, activation_checkpointing=CHECKPOINTING)
    config["expert_parallel"]["autoep_size"] = 2
    path = tmp / f"{name.split('/')[-1]}-fp32-ep2-recompute.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("moe")
    recipe = small_recipe(tmp, corpus, name="moe", model={"moe": MOE})
    qwen3_moe = small_recipe(tmp, corpus, name="qwen3_moe", model=QWEN3_MOE)
    llama4_moe = small_recipe(tmp, corpus, name="llama4_moe", model=LLAMA4_MOE)
    zero2 = ds_config(tmp, "zero2")
    ep2_zero2 = ds_config(tmp, "zero2", expert_parallel={"enabled": True, "autoep_size": 2})
    configs = {
        "zero1": ROOT / "ds_configs" / "zero1.json",
        "ep2_zero1": ROOT / "ds_configs" / "ep2_zero1.json",
        "zero2": zero2,
        "ep2_zero2": ep2_zero2,
        "zero1_recompute": ds_config(tmp, "zero1", activation_checkpointing=CHECKPOINTING),
        "ep2_zero1_recompute": ds_config(tmp, "ep2_zero1", activation_checkpointing=CHECKPOINTING),
        "shipped_layout": shipped_layout_in_fp32(tmp),
    }
    families = {f"{family}_{n}": (path, n) for family, path in (("qwen3_moe", qwen3_moe), ("llama4_moe", llama4_moe))
                for n in ("zero1", "ep2_zero1")}  # fmt: skip
    d = {name: tmp / name for name in [*configs, "ep2_resumed", *families]}
    calls = [("train", [train_argv(recipe, config, d[name])]) for name, config in configs.items()]
    calls += [("train", [train_argv(path, configs[n], d[name])]) for name, (path, n) in families.items()]
    resumed = train_argv(recipe, configs["ep2_zero1"], d["ep2_resumed"], "train.checkpoint_interval=3")
    calls += [
        ("train_and_signal_at", [resumed, 4]),
        ("train", [train_argv(recipe, configs["ep2_zero1"], d["ep2_resumed"])]),
    ]
    results = run_ranks(2, run_all, calls)
    assert results == [[0] * len(calls)] * 2
    # 4 ranks: EP2 x expert-data-parallel 2 against EP1, micro-batch 2 (the global batch of 8 over 4 replicas)
    four = {"zero1_dp4": ds_config(tmp, "zero1", train_micro_batch_size_per_gpu=2)}
    four["ep2_dp4"] = ds_config(tmp, "ep2_zero1", train_micro_batch_size_per_gpu=2)
    d.update({name: tmp / name for name in four})
    assert run_ranks(4, run_all, [("train", [train_argv(recipe, c, d[n])]) for n, c in four.items()]) == [[0, 0]] * 4
    return d


def train_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "split" not in r]


@pytest.mark.parametrize(
    "run, reference",
    [
        ("ep2_zero1", "zero1"),
        ("ep2_zero2", "zero2"),
        ("zero2", "zero1"),
        ("ep2_dp4", "zero1_dp4"),
        ("qwen3_moe_ep2_zero1", "qwen3_moe_zero1"),
        ("llama4_moe_ep2_zero1", "llama4_moe_zero1"),
        ("shipped_layout", "ep2_zero1"),  # DeepSpeed takes the planner's MoE layout, CPU Adam and recompute
    ],
)
def test_expert_parallel_gives_the_same_losses_and_gradients(runs, run, reference):
    ours, theirs = train_records(runs[run]), train_records(runs[reference])
    assert len(ours) == len(theirs) == 10
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "grad_norm"):
        a = [r[key] for r in ours]
        b = [r[key] for r in theirs]
        assert a == pytest.approx(b, rel=RTOL), key


@pytest.mark.parametrize("run, reference", [("zero1_recompute", "zero1"), ("ep2_zero1_recompute", "ep2_zero1")])
def test_activation_checkpointing_keeps_the_router_losses_and_their_gradients(runs, run, reference):
    ours, theirs = train_records(runs[run]), train_records(runs[reference])
    assert len(ours) == len(theirs) == 10
    keys = ["loss", "moe_aux_loss", "moe_z_loss", "grad_norm", "moe_layer0_share_max", "moe_layer1_share_entropy"]
    for key in keys:
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=RECOMPUTE_RTOL, abs=0), key


def test_metrics_record_router_losses_and_expert_shares(runs):
    records = train_records(runs["ep2_zero1"])
    first, last = records[0], records[-1]
    assert last["loss"] < first["loss"] - 0.3
    for layer in ("moe_layer0", "moe_layer1"):
        assert 0 < last[f"{layer}_share_min"] <= 0.25 <= last[f"{layer}_share_max"] < 1  # every expert gets tokens
        assert 0 < last[f"{layer}_share_entropy"] <= math.log(4) + 1e-9
    assert 1.9 < first["moe_aux_loss"] < 2.5  # top_k = 2 at uniform routing
    assert first["moe_z_loss"] > 0


def test_signal_checkpoints_and_resume_continues_exactly(runs):
    resumed, straight = train_records(runs["ep2_resumed"]), train_records(runs["ep2_zero1"])
    assert [r["step"] for r in resumed] == list(range(1, 11))  # stopped after step 4, resumed at 5
    folders = sorted(p.name for p in (runs["ep2_resumed"] / "checkpoints").iterdir() if p.is_dir())
    assert folders == ["global_step10", "global_step4"]
    for key in ("loss", "moe_aux_loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key  # bit for bit


def test_expert_parallel_checkpoint_exports_to_mixtral_with_our_logits(runs):
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model
    from dstrain.recipe_file import load_recipe

    recipe = load_recipe(runs["ep2_zero1"] / "recipe.yaml")
    states = [consolidated_state_dict(load_run(runs[n], None)[1], recipe.model) for n in ("ep2_zero1", "zero1")]
    assert states[0].keys() == states[1].keys()
    assert all(torch.allclose(states[0][k], states[1][k], rtol=0, atol=1e-6) for k in states[0])
    model = GPT(recipe.model).eval()
    model.load_state_dict(states[0], strict=True)
    hf = to_hf_model(recipe.model, states[0])
    tokens = torch.randint(0, recipe.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
