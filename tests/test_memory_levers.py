"""The memory levers (docs/memory.md): what dstrain estimate counts for the chunked loss and the tiled MLP, the
chunked loss as the default where the logits are large, and what dstrain plan weighs and says. Same math under every
strategy: tests/test_tiling.py, and the chunked runs of tests/test_train.py, test_parallel.py, test_sequence.py."""

from __future__ import annotations

import dataclasses

import pytest
from test_estimate_measured import saved_tensor_bytes, write_recipe

from dstrain.commands.cli import main as cli
from dstrain.plan.layouts import Layout, plan
from dstrain.plan.memory import estimate
from dstrain.plan.memory_parts import GIB
from dstrain.plan.param_counts import count_params
from dstrain.plan.time_model import DEVICES, Cluster, predict
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

from train_helpers import ROOT

H100 = DEVICES["h100-sxm"]


def _strategy(recipe, layout: Layout, world: int):
    return resolve(recipe, "r.yaml", layout.ds_config("bf16", False), "c.json", world, check_device=False)


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_tiled_loss_and_mlp_save_what_the_formula_says(tmp_path, flavour):
    """A chunked loss saves no log-probabilities and a tiled MLP only its input: the formula's saved bytes against
    autograd's (and the tiled functions' own) saved tensors, fp32, 4 loss tiles and 2 MLP tiles."""
    import torch

    kv = {"n_kv_head": 2} if flavour == "llama" else {"n_kv_head": None}
    recipe_file = write_recipe(tmp_path, n_layer=2, flavour=flavour, **kv)
    recipe = load_recipe(recipe_file)
    path = ROOT / "ds_configs" / "zero2.json"
    ds = {**load_ds_config(path), "tiling": {"loss": 4, "mlp": 2}}
    strategy = resolve(recipe, recipe_file, ds, path, 2)
    est = estimate(recipe, strategy, 1, 2, fused_norms=False)
    formula = next(p.backward for p in est.parts if p.name == "saved for backward")
    measured = saved_tensor_bytes(recipe.model, strategy.micro_batch, 32, torch.float32, tiles=(4, 2))
    print(f"tiled activations {flavour}: formula {formula:,} B, saved {measured:,} B ({formula / measured - 1:+.3%})")
    assert abs(formula / measured - 1) < 0.001
    plain = estimate(recipe, resolve(recipe, recipe_file, {**ds, "tiling": {"loss": 1}}, path, 2), 1, 2)
    tokens, vocab = strategy.micro_batch * 32, recipe.model.vocab_size
    logits = {p.name: p.backward for p in est.parts + plain.parts if "logits" in p.name}
    d = recipe.model.d_model
    assert logits == {
        "logits gradient (backward start)": 8 * tokens * vocab,
        # one chunk's working set, the hidden states' gradient, the head's fp32 gradient (fp32: no second copy)
        "chunked loss: 1 of 4 chunks' logits, head gradients (forward end)": 12 * tokens // 4 * vocab
        + 4 * tokens * d
        + 4 * vocab * d,
    }


def test_chunked_loss_is_the_default_where_the_logits_are_large():
    """continue-qwen2.5-0.5b under zero1_bf16 on 8 GPUs (micro-batch 4 of 4096 tokens, 151,936-entry vocabulary):
    the whole loss would hold 12·T·V = 27.8 GiB; "auto" (the key absent) cuts each sequence into 32 chunks, the
    logits' part falls from 18.55 GiB to one chunk's and the head's gradients, under 2 GiB (0.87 GiB of logits,
    0.76 of the head's fp32 and bf16 gradients)."""
    recipe_file = ROOT / "recipes" / "continue-qwen2.5-0.5b.yaml"
    recipe = load_recipe(recipe_file)
    config = load_ds_config(ROOT / "ds_configs" / "zero1_bf16.json")
    assert "tiling" not in config
    chunked = estimate(recipe, resolve(recipe, recipe_file, config, "zero1_bf16", 8, check_device=False), 1, 8)
    whole = resolve(recipe, recipe_file, {**config, "tiling": {"loss": 1}}, "zero1_bf16", 8, check_device=False)
    whole_est = estimate(recipe, whole, 1, 8)
    logits = [next(p.backward for p in e.parts if "logits" in p.name) for e in (whole_est, chunked)]
    assert logits[0] / GIB == pytest.approx(18.55, abs=0.005) and logits[1] < 2 * GIB
    assert any(p.name.startswith("chunked loss: 1 of 32 chunks") for p in chunked.parts)
    assert whole_est.peak() - chunked.peak() > 26 * GIB  # the saved fp32 log-probs go too


def test_a_recipe_that_fits_nowhere_is_told_the_fewest_nodes_that_fit(capsys):
    """llama-7b on 2 devices of 5 GiB: no layout fits one node; the planner names the fewest such nodes on which one
    does (8: ZeRO-3 with the optimizer and parameters offloaded, 16 ranks' shares), and 8 does fit while 7 does not."""
    from dstrain.plan.layouts import fits_somewhere

    recipe_file = ROOT / "recipes" / "llama-7b.yaml"
    argv = ["plan", "--recipe", str(recipe_file), "--gpus-per-node", "2", "--device-memory", "5"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no layout dstrain accepts fits 1 x 2 devices of 5 GiB" in err[0], err
    assert "what fits: 8 nodes (--nodes 8)" in err[0]
    recipe, small = load_recipe(recipe_file), dataclasses.replace(H100, memory_gib=5)
    assert fits_somewhere(recipe, Cluster(small, 8, 2), "bf16")
    assert not fits_somewhere(recipe, Cluster(small, 7, 2), "bf16")


def test_plan_weighs_the_chunked_loss_at_no_extra_compute():
    """qwen2.5-0.5b's 151,936-entry vocabulary: the chunked loss frees the logits (a larger micro-batch fits on 40
    GiB), and the time model charges it nothing: the fused loss runs the head's matmuls once (model/chunked_loss.py;
    measured: bench/bench_fused_loss.py)."""
    recipe_file = ROOT / "recipes" / "continue-qwen2.5-0.5b.yaml"
    recipe, cluster = load_recipe(recipe_file), Cluster(dataclasses.replace(H100, memory_gib=40), 1, 8)
    kept, _ = plan(recipe, cluster, "bf16", top=10_000)
    largest = {
        chunked: max(
            p.strategy.micro_batch
            for p in kept
            if p.layout.chunked_loss == chunked
            and p.layout.zero == 1
            and p.layout.tp * p.layout.pp * p.layout.sp == 1
            and not p.layout.checkpointing
        )
        for chunked in (False, True)
    }
    assert largest[True] > largest[False]
    whole, chunked = (_strategy(recipe, Layout(zero=1, micro=4, chunked_loss=c), 8) for c in (False, True))
    assert (whole.loss_tiles, chunked.loss_tiles) == (1, 32)
    counts = count_params(recipe.model)
    times = [predict(recipe, s, counts, cluster) for s in (whole, chunked)]
    assert times[1].compute_s == times[0].compute_s and times[1].step_s == times[0].step_s


def test_the_shipped_qwen25_layout_is_the_planners_and_chunks_its_loss():
    """dstrain plan for continue-qwen2.5-0.5b on 1 x 8 H100 writes what ds_configs/planned ships: the loss chunked
    (the whole loss's 18.55 GiB of logits' gradient, at no time cost, buy micro-batch 16 where the whole loss stopped
    at 4)."""
    import json

    recipe_file = ROOT / "recipes" / "continue-qwen2.5-0.5b.yaml"
    kept, _ = plan(load_recipe(recipe_file), Cluster(H100, 1, 8), "bf16", top=1)
    shipped = json.loads((ROOT / "ds_configs" / "planned" / "continue-qwen2.5-0.5b-1x8-h100.json").read_text())
    assert kept[0].ds_config == shipped
    assert shipped["tiling"]["loss"] == 128 and shipped["train_micro_batch_size_per_gpu"] == 16


def tied_head_steps(stage: int, tiles: int) -> list[tuple[float, float]]:
    """Rank target: 3 steps of a tied gpt2 under ZeRO ``stage`` on this rank's share of a fixed batch, the loss whole
    (tiles 1) or chunked: (loss, pre-clip gradient norm) per step."""
    import deepspeed
    import torch

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT, lm_loss
    from dstrain.train.engine import tiling
    from dstrain.train.process import distributed

    distributed.init()
    config = GPTConfig(flavour="gpt2", vocab_size=128, max_seq_len=16, n_layer=1, n_head=2, d_model=32)
    ds = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,  # 1/2 reaches the head's gradient too
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=stage == 3):  # without a config: fp16 parameters
        model = GPT(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    rank, out = torch.distributed.get_rank(), []
    for step in range(3):
        for micro in range(2):
            ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(10 * step + micro))
            inputs, labels = ids[rank::2, :-1], ids[rank::2, 1:].clone()
            labels[:, :3] = -100  # SFT's prompt tokens
            if tiles > 1:
                loss = tiling.mean_loss(engine.module.lm_head, engine(inputs, head=False), labels, tiles)
            else:
                loss = lm_loss(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
        out.append((loss.item(), float(engine.get_global_grad_norm())))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_chunked_loss_with_a_tied_head_gives_the_whole_losses_under_zero(stage):
    """A head tied to the embedding under ZeRO-2 and ZeRO-3 (2 gloo ranks, fp32, gradient accumulation 2, masked
    labels): the fused chunked loss forms the head's gradient in its forward and returns it once in the backward, so
    ZeRO reduces the tied weight's summed gradient once (DeepSpeed's tiled compute needed a hold on its reduction)
    and ZeRO-3 gathers the weight for the head's forward; losses and pre-clip norms within 1e-6 of the whole loss."""
    from ranks import run_ranks

    whole = run_ranks(2, tied_head_steps, stage, 1)
    chunked = run_ranks(2, tied_head_steps, stage, 4)
    for rank_whole, rank_chunked in zip(whole, chunked):
        for (loss, norm), (c_loss, c_norm) in zip(rank_whole, rank_chunked):
            assert abs(c_loss - loss) <= 1e-6 * loss and abs(c_norm - norm) <= 1e-6 * norm, (rank_whole, rank_chunked)
