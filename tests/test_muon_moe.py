"""Muon with DeepSeekMoE (MLA attention, sigmoid routing with groups, a shared expert, a dense first block, the
balancing bias): what DeepSpeed 0.19.8 does with the experts' matrices, and that it is the same math under every
layout dstrain accepts it in.

DeepSpeed's own per-expert path (``muon_update(is_expert_group=True)``: Newton-Schulz batched over a 3-D stack) is for
AutoEP's fused expert tensors (deepspeed/moe/ep_experts.py). dstrain's MoE layer is DeepSpeed's classic one
(model/moe.py): every routed expert holds its own 2-D ``nn.Linear`` weights, ``set_optimizer_flags`` gives each
``use_muon``, the engine splits the Muon half into expert groups (``split_params_into_different_moe_groups_for_
optimizer``, keeping ``use_muon``; the groups are renamed "ep_size_N"), and Muon runs on each expert matrix alone: at
ZeRO-0 in ``MuonWithAuxAdam.step`` on the whole parameter, at ZeRO-1/2 in ``get_flat_partition`` on each whole
gradient (all-reduced over the expert-data-parallel group, ``muon_copy_ranks``), run in ``step`` once
train/engine/muon_zero.py has clipped it. The probe below holds every expert's first update to a plain Newton-Schulz on
that
expert's own gradient; the training runs hold EP1, EP2, ZeRO-0/1/2 and accumulation 1 and 2 to the same losses,
pre-clip norms and weights."""

import json

import pytest
import torch
import yaml
from test_deepseek_strategies import DEEPSEEK_MOE, MLA_MODEL
from test_muon import reference_orthogonalise  # fp64 Newton-Schulz on one matrix, with Muon's aspect-ratio scale

from ranks import run_ranks
from train_helpers import ROOT, read_metrics, small_recipe, train_argv, train_each

pytestmark = pytest.mark.distributed

RTOL = 1e-5  # fp32: the same sums in another order (EP2's joined expert matmuls, partitions, micro-batches)
CLIP = 0.5  # below the recipe's norms from step 1: every step is clipped before Muon
EP2 = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
SHIPPED = "planned/continue-moonlight-16b-a3b-1x8-h100"  # ZeRO-0, experts over 4 of 8 ranks, the loss in 8 chunks
LAYOUTS = {  # name -> (ds_config, changes): ZeRO-0 EP1 with 1 micro-batch a step is the reference
    "zero0": ("zero0", {}),
    "shipped_ep2_accum": (SHIPPED, {"train_micro_batch_size_per_gpu": 2, **EP2}),  # its layout on 2 ranks
    "zero1": ("zero1", {}),
    "ep2_zero1": ("ep2_zero1", {}),
    "zero2_accum": ("zero2", {"train_micro_batch_size_per_gpu": 2}),
    "ep2_zero2_accum": ("zero2", {"train_micro_batch_size_per_gpu": 2, **EP2}),
}
STEPS = 5
# Each expert's first step against first_muon_update of its gradient, in units of the step's largest entry: DeepSpeed
# runs Newton-Schulz in fp32 (measured <= 2.8e-6 of the step against the fp64 reference, on every expert and layout;
# without the Nesterov blend's scale in the reference, 2e-4). Newton-Schulz of the layer's stacked experts: 0.4-0.85.
EXPERT_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("muon_moe")
    model = {**MLA_MODEL, "moe": DEEPSEEK_MOE}
    recipe = small_recipe(tmp, corpus, name="muon_moe", model=model, optim={"kind": "muon", "grad_clip": CLIP})
    dirs = {name: tmp / name for name in LAYOUTS}
    argv = []
    for name, (base, changes) in LAYOUTS.items():
        config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text()) | changes
        # The AdamW half in torch, as the CPU configs have it: the planned layout's FusedAdam is a GPU op, and its
        # CPU build took 2 of this fixture's minutes
        config["optimizer"]["params"]["torch_adam"] = True
        (tmp / f"{name}.json").write_text(json.dumps(config))
        argv.append(train_argv(recipe, tmp / f"{name}.json", dirs[name], f"train.steps={STEPS}"))
    assert run_ranks(2, train_each, argv) == [[0] * len(argv)] * 2
    return dirs


def train_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "split" not in r]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.recipe_file import load_recipe

    recipe = load_recipe(run_dir / "recipe.yaml")
    return consolidated_state_dict(load_run(run_dir, None)[1], recipe.model)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "zero0"])
def test_muon_with_deepseek_moe_gives_the_same_losses_norms_and_weights(runs, layout):
    ours, reference = train_records(runs[layout]), train_records(runs["zero0"])
    assert len(ours) == len(reference) == STEPS and min(r["grad_norm"] for r in reference) > CLIP
    keys = ["loss", "grad_norm", "moe_layer1_bias_min", "moe_layer1_bias_max", "moe_layer1_share_max"]
    for key in keys:
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], rel=RTOL), key
    got, want = final_weights(runs[layout]), final_weights(runs["zero0"])
    assert got.keys() == want.keys() and any(".experts." in key for key in want), sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=RTOL, msg=key)


# --- each expert's update: Newton-Schulz on its own gradient ---------------------------------------------------


def first_muon_update(grad: torch.Tensor) -> torch.Tensor:
    """Muon's first update from a zero momentum: the momentum (1 - BETA) * grad, Nesterov's blend of it with the
    gradient, Newton-Schulz. The blend only scales the gradient, which Newton-Schulz normalises away, but for the 1e-7
    it adds to the norm: on a small expert gradient that is a visible part of it."""
    grad = grad.double()
    return reference_orthogonalise(grad.lerp((1 - BETA) * grad, BETA))


BETA = 0.95
PROBE_RECIPE = {
    "name": "probe",
    "seed": 3,
    "model": {"flavour": "llama", "vocab_size": 97, "n_layer": 2, "n_head": 4, "d_model": 32, **MLA_MODEL},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
    "optim": {"kind": "muon", "weight_decay": 0.1, "grad_clip": 0.0, "muon": {"lr": 0.05, "momentum": BETA}},
    "schedule": {"warmup_steps": 0},
}
PROBE_RECIPE["model"]["moe"] = {**DEEPSEEK_MOE, "bias_update_rate": 0.0}


def probe_engine(folder, base: str, changes: dict):
    """dstrain's engine for the probe recipe under ``base`` + ``changes``, on this process group."""
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_engine, build_model

    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text()) | changes
    path = folder / f"{base}-{torch.distributed.get_rank()}-{'-'.join(changes)}.json"
    path.write_text(json.dumps(config))
    recipe = load_recipe(folder / "probe.yaml")
    strategy = resolve(recipe, folder / "probe.yaml", load_ds_config(path), path, torch.distributed.get_world_size())
    return build_engine(recipe, strategy, build_model(recipe, strategy)), recipe


def expert_weights(engine) -> dict[str, torch.Tensor]:
    """This rank's routed experts' matrices by their global name (layer, expert index, projection)."""
    from deepspeed.utils import groups

    from dstrain.model.moe import MoEMLP

    found = {}
    for layer, block in enumerate(engine.module.blocks):
        if isinstance(block.mlp, MoEMLP):
            moe = block.mlp.moe
            local = moe.deepspeed_moe.experts.deepspeed_experts
            first = groups._get_expert_parallel_rank(moe.expert_group_name) * len(local) if moe.ep_size > 1 else 0
            for index, expert in enumerate(local):
                for name, param in expert.named_parameters():
                    found[f"{layer}.{first + index}.{name}"] = param
    return found


def one_backward(engine, recipe) -> None:
    from dstrain.model.gpt import lm_loss

    generator = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    tokens = torch.randint(0, recipe.model.vocab_size, (8, 17), generator=generator)
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))


def expert_steps(folder, base: str, changes: dict, grads: dict[str, torch.Tensor]) -> dict:
    """One Muon step under ``base`` + ``changes``; per expert matrix on this rank, how far its step is from
    ``lr * first_muon_update(its gradient)`` (after weight decay) and from Newton-Schulz on the stack of its layer's
    experts, relative to the step's largest entry; and each optimizer group's (name, weight decay, decays)."""
    from dstrain.train.engine.build import decays

    engine, recipe = probe_engine(folder, base, changes)
    before = {name: param.detach().clone() for name, param in expert_weights(engine).items()}
    one_backward(engine, recipe)
    lr = next(g["lr"] for g in engine.optimizer.param_groups if g["use_muon"])
    engine.step()
    stacks: dict[tuple[str, str], list[torch.Tensor]] = {}
    for name, grad in grads.items():
        layer, _, projection = name.split(".", 2)
        stacks.setdefault((layer, projection), []).append(grad)
    found = {}
    for name, param in expert_weights(engine).items():
        step = before[name].double() * (1 - lr * recipe.optim.weight_decay) - param.detach().double()
        layer, expert, projection = name.split(".", 2)
        rows = grads[name].size(0)
        stacked = first_muon_update(torch.cat(stacks[(layer, projection)]))
        stacked = stacked[int(expert) * rows : (int(expert) + 1) * rows]
        scale = lr * first_muon_update(grads[name]).abs().max()
        found[name] = (
            ((step - lr * first_muon_update(grads[name])).abs().max() / scale).item(),
            ((step - lr * stacked).abs().max() / scale).item(),
        )
    groups = [(g["name"], g["weight_decay"], decays(g, i)) for i, g in enumerate(engine.optimizer.param_groups)]
    return {"experts": found, "groups": groups}


def probe_expert_updates(folder, layouts: dict) -> dict:
    """Rank target (2 ranks): each routed expert's gradient of one micro-batch per rank under ZeRO-0 EP1 (the
    data-parallel mean), then ``expert_steps`` of the same model and micro-batches under each layout."""
    from dstrain.train.process import distributed

    distributed.init()
    with torch.compiler.set_stance("force_eager"):  # as dstrain runs Muon on a CPU (engine.run_muon_eagerly_on_cpu)
        reference, recipe = probe_engine(folder, "zero0", {})
        one_backward(reference, recipe)
        grads = {name: param.grad.detach().clone() for name, param in expert_weights(reference).items()}
        return {name: expert_steps(folder, base, changes, grads) for name, (base, changes) in layouts.items()}


@pytest.fixture(scope="module")
def expert_updates(tmp_path_factory):
    folder = tmp_path_factory.mktemp("muon_moe_probe")
    (folder / "probe.yaml").write_text(yaml.safe_dump(PROBE_RECIPE))
    layouts = {"zero0": ("zero0", {}), "zero0_ep2": ("zero0", EP2), "ep2_zero1": ("ep2_zero1", {})}
    layouts |= {"zero2": ("zero2", {}), "ep2_zero2": ("zero2", EP2)}
    ranks = run_ranks(2, probe_expert_updates, folder, layouts)
    return {name: [rank[name] for rank in ranks] for name in layouts}


@pytest.mark.parametrize("layout", ["zero0", "zero0_ep2", "ep2_zero1", "zero2", "ep2_zero2"])
def test_each_expert_takes_newton_schulz_of_its_own_gradient(expert_updates, layout):
    """Every routed expert matrix of both MoE blocks, on the rank(s) holding it: its first Muon step is
    lr * NS(its gradient) to EXPERT_RTOL of the step; Newton-Schulz on its layer's stack of experts is far off."""
    for rank in expert_updates[layout]:
        experts = rank["experts"]
        assert len(experts) == 3 * DEEPSEEK_MOE["num_experts"] // (2 if "ep2" in layout else 1)  # 1 MoE block
        for name, (own, stacked) in experts.items():
            assert own < EXPERT_RTOL, (name, own)
            assert stacked > 0.1, (name, stacked)


def test_every_muon_group_decays_after_the_moe_split(expert_updates):
    """DeepSpeed renames the expert groups after their expert-parallel group ("ep_size_2"): train/engine.decays,
    which resume uses to set the recipe's weight decay again, still finds the decayed ones."""
    for rank in expert_updates["ep2_zero1"]:
        assert any(name.startswith("ep_size_2") for name, _, _ in rank["groups"]), rank["groups"]
        for name, weight_decay, decays in rank["groups"]:
            assert decays == (weight_decay > 0), (name, weight_decay, decays)


@pytest.mark.parametrize(
    "base, changes, fragment",
    [
        ("ep2_zero1_bf16", {}, "bf16 optimizer refuses Muon with MoE layers: Muon with model.moe trains in fp32"),
        ("zero1_bf16", {}, "bf16 optimizer refuses Muon with MoE layers: Muon with model.moe trains in fp32"),
        ("ep2_zero2_bf16", {}, "bf16 ZeRO-2 hands Muon bf16 gradients"),
        ("zero2_offload", EP2, "under ZeRO stage 2 with offload DeepSpeed 0.19.8 clips Muon's orthogonalised"),
        ("zero3", {"zero_optimization": {"stage": 3, "reduce_scatter": False}}, "ZeRO-3 cannot train"),
    ],
)
def test_the_layouts_muon_with_moe_stays_refused_under(tmp_path, base, changes, fragment):
    """bf16 (ZeRO-1's BF16_Optimizer raises on Muon with MoE layers; bf16 ZeRO-2 keeps bf16 gradients),
    optimizer offload (Muon orthogonalised before the clip) and ZeRO-3 (DeepSpeed's classic MoE refuses it)."""
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(PROBE_RECIPE))
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text()) | changes
    path = tmp_path / "d.json"
    path.write_text(json.dumps(config))
    with pytest.raises(DstrainError) as e:
        resolve(load_recipe(tmp_path / "probe.yaml"), tmp_path / "probe.yaml", load_ds_config(path), path, 2)
    assert "\n" not in str(e.value) and fragment in str(e.value), str(e.value)
    if "ZeRO-3" not in fragment:  # refused by the MoE check, before Muon's
        assert str(e.value).endswith(
            "use ds_configs/zero0.json, zero1.json, zero2.json or ep2_zero1.json (fp32: tests/test_muon_moe.py)"
        )


@pytest.mark.deepspeed_defect(
    "DeepSpeed 0.19.8's BF16_Optimizer refuses Muon with MoE layers (strategy/optimizer.py::MUON_MOE_IN_BF16)"
)
def test_deepspeeds_bf16_optimizer_refuses_muon_with_moe_layers():
    """bf16 ZeRO-1 (the one bf16 Muon path dstrain accepts) raises in its constructor for a model with MoE layers,
    before it touches a process group. When this fails, prove zero1_bf16 with model.moe as tests/test_muon.py proves
    it for dense models, and lift MUON_MOE_IN_BF16 for it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    matrix = torch.nn.Parameter(torch.zeros(4, 4))
    muon = MuonWithAuxAdam([{"params": [matrix], "use_muon": True, "lr": 0.02, "momentum": 0.95, "weight_decay": 0}])
    with pytest.raises(ValueError, match="BF16 Muon currently requires FP32 accumulation, dense DP"):
        BF16_Optimizer(muon, {matrix: "w"}, None, grad_acc_dtype=torch.float32, has_moe_layers=True)
