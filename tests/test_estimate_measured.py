"""dstrain estimate against what is measured: the tensors 2 ranks really hold under every CPU strategy, and autograd's
saved tensors for the activations."""

import collections

import pytest
import yaml

from dstrain.model.config import GPTConfig
from dstrain.plan.memory import estimate, estimate_file
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

from ranks import run_ranks
from train_helpers import ROOT

# Every shipped strategy that runs on a CPU: fp32 ZeRO-0..3, optimizer (and parameter) offload, bf16 ZeRO-1..3.
REALITY_CONFIGS = [
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "zero2_offload",
    "zero3_offload",
    "zero1_bf16",
    "zero2_bf16",
    "zero3_bf16",
]
REALITY_RTOL = 0.10  # the bound the estimator promises; the measured gaps are printed (well under 1%)


def write_recipe(folder, **model):
    """A recipe that names its vocabulary, so nothing reads data: 2 llama blocks, 16 x 32 tokens per step."""
    recipe = {
        "name": "estimate-check",
        "seed": 3,
        "model": {
            "flavour": "llama",
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 128,
            "vocab_size": 2048,
            **model,
        },
        "data": {"sources": [{"path": str(folder / "no-data")}], "seq_len": 32},
        "train": {"global_batch": 16, "steps": 2},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# --- the estimate against the tensors DeepSpeed keeps, on 2 gloo ranks ----------------------------------


def reachable_tensors(root) -> dict[int, tuple[str, int]]:
    """storage -> (first path, bytes) of every tensor reachable from the engine: its module, optimizer(s), buffers.

    Hand-written: no library lists the tensors an object graph keeps, and on a CPU the allocator counts the
    whole process (DeepSpeed's CPU accelerator reports RSS), so counting storages is the one exact measure.
    """
    import torch

    found, seen = {}, set()
    stack = [("engine", root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (path, storage.nbytes())
            for attr in ("grad", "ds_tensor"):  # a parameter's gradient; ZeRO-3's partition
                if isinstance(getattr(obj, attr, None), torch.Tensor):
                    stack.append((f"{path}.{attr}", getattr(obj, attr)))
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(f"{path}<key>", k) for k in obj if isinstance(k, torch.Tensor)]
            stack += [(f"{path}[{k if isinstance(k, (str, int)) else '.'}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, collections.deque)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch", "dstrain"):
            stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return found


def classify(engine, found) -> dict[str, int]:
    """Bytes per group: module parameters (and ZeRO-3 partitions), optimizer states (fp32 masters, Adam moments),
    gradients (every .grad and DeepSpeed's gradient partitions), buffers (buckets, offload staging)."""

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.untyped_storage().nbytes()}

    params = storages(t for p in engine.module.parameters() for t in (p, getattr(p, "ds_tensor", None)))
    basic = engine.basic_optimizer
    optimizer = storages(
        [p for g in basic.param_groups for p in g["params"]]
        + list(basic.state)  # masters
        + [v for state in basic.state.values() for v in state.values() if hasattr(v, "untyped_storage")]
    )
    sizes = collections.Counter()
    for ptr, (path, nbytes) in found.items():
        last = path.rsplit(".", 1)[-1]
        if "ipg_buckets" in path or "temp_grad_buffer" in path:
            group = "buffers"
        elif ptr in params or "param_buffer_of_bit16" in last:
            group = "parameters"
        elif ptr in optimizer:
            group = "optimizer states"
        elif "grad" in last:
            group = "gradients"  # .grad, averaged_gradients, all_grad_tensors, accumulated_grads_in_cpu, ...
        else:
            group = "other"
        sizes[group] += nbytes
    return dict(sizes)


def held_bytes(recipe_file: str, configs: list[str]) -> list[dict]:
    """Rank target: train 2 steps of 2 micro-batches per config; the most each group held at any snapshot.

    Snapshots: after each backward of step 2 (gradients accumulating, then reduced) and at the optimizer
    step of step 2 (fp32 gradient copies, optimizer states), i.e. around each phase of dstrain.commands.estimate.
    """
    import torch

    from dstrain.model.gpt import lm_loss
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.process import distributed

    distributed.init()
    recipe = load_recipe(recipe_file)
    results = []
    for name in configs:
        path = ROOT / "ds_configs" / f"{name}.json"
        strategy = resolve(recipe, recipe_file, load_ds_config(path), path, torch.distributed.get_world_size())
        engine = build_engine(recipe, strategy, build_model(recipe, strategy))
        snapshots = []

        def at_step(*_, engine=engine, snapshots=snapshots) -> None:
            if engine.global_steps == 1:
                snapshots.append(classify(engine, reachable_tensors(engine)))

        engine.basic_optimizer.register_step_pre_hook(at_step)
        generator = torch.Generator().manual_seed(torch.distributed.get_rank())
        for step in range(2):
            for _ in range(strategy.grad_accum):
                tokens = torch.randint(0, recipe.model.vocab_size, (strategy.micro_batch, 33), generator=generator)
                engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
                if step == 1:
                    snapshots.append(classify(engine, reachable_tensors(engine)))
                engine.step()
        groups = {g for s in snapshots for g in s}
        peak = {g: max(s.get(g, 0) for s in snapshots) for g in groups}
        peak["model states"] = max(sum(v for g, v in s.items() if g != "buffers") for s in snapshots)
        results.append(peak)
        engine.destroy()
        del engine
    return results


@pytest.mark.distributed
def test_model_states_match_what_two_ranks_hold(tmp_path):
    recipe_file = str(write_recipe(tmp_path))
    measured = run_ranks(2, held_bytes, recipe_file, REALITY_CONFIGS, env={"OMP_NUM_THREADS": "1"})
    recipe = load_recipe(recipe_file)
    print(f"\n{'config':14} {'group':17} {'estimate MB':>12} {'held MB':>10} {'gap':>8}")
    worst = 0.0
    for name, rank0, rank1 in zip(REALITY_CONFIGS, *measured):
        est = estimate_file(recipe, ROOT / "ds_configs" / f"{name}.json", 1, 2, fused_norms=False)
        groups = {
            g: max(sum(getattr(p, ph) for p in est.parts if p.group == g) for ph in ("backward", "step"))
            for g in ("parameters", "gradients", "optimizer states")
        }
        groups["model states"] = est.model_states()
        for group, expected in groups.items():
            for held in (rank0, rank1):
                gap = held.get(group, 0) / expected - 1 if expected else held.get(group, 0)
                worst = max(worst, abs(gap))
                assert abs(gap) <= REALITY_RTOL, (
                    f"{name} {group}: estimate {expected:,} B, rank holds {held.get(group, 0):,} B"
                )
            print(f"{name:14} {group:17} {expected / 1e6:12.3f} {rank0.get(group, 0) / 1e6:10.3f} {gap:+8.2%}")
        assert rank0.get("other", 0) < 0.001 * groups["model states"]  # nothing sizeable escaped the groups
        buffers = sum(max(p.backward, p.step) for p in est.parts if p.group == "buffers")
        assert rank0.get("buffers", 0) <= buffers  # persistent buckets and staging buffers never exceed the estimate
    print(f"largest gap over {len(REALITY_CONFIGS)} configs x 4 groups x 2 ranks: {worst:.3%}")


# --- activations against autograd's saved tensors ---------------------------------------------------------


def saved_tensor_bytes(
    config: GPTConfig, batch: int, seq: int, dtype, checkpointed: bool = False, tiles: tuple[int, int] = (1, 1)
) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward (parameters excluded), with the
    blocks run through DeepSpeed's activation checkpointing as the trainer applies it, or plainly; ``tiles``: the
    loss and MLP tiles of dstrain.train.engine.tiling."""
    import deepspeed
    import torch

    from dstrain.model.gpt import GPT, lm_loss
    from dstrain.train.engine import tiling

    torch.manual_seed(0)
    model = GPT(config).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def checkpointed_block(block, x, *position_ids):
        # DeepSpeed's CheckpointFunction keeps its inputs on ctx (deepspeed_saved_tensors), out of the hooks' sight.
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return deepspeed.checkpointing.checkpoint(block, x, *position_ids)

    if checkpointed:
        model.checkpoint_fn = checkpointed_block

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
    if tiles[1] > 1:
        tiling.tile_mlps(model, tiles[1])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if tiles[0] == 1:
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        else:  # the fused chunked loss saves its gradients of the hidden states and the head (counted apart)
            hidden, labels = model(tokens[:, :-1], head=False), tokens[:, 1:]
            gradients = tiling.tiled_loss_sum(model.lm_head, hidden, labels, tiles[0]).grad_fn.saved_tensors
            for kept in gradients:  # in the formula's loss part (fused_loss_bytes), not in "saved for backward"
                saved.pop(kept.untyped_storage().data_ptr())
    return sum(saved.values())


# Qwen3's features: per-head q/k norms (their saved fp32 copies) and a head width apart from d_model / n_head
QWEN3 = {"flavour": "llama", "family": "qwen3", "qk_norm": "head", "d_head": 64}


# Gemma 3's: the sandwich's two norms more per block, (1 + w) RMSNorm, GeGLU in place of SwiGLU
GEMMA3 = {"flavour": "llama", "norm_placement": "sandwich", "mlp_activation": "gelu_tanh", "norm_unit_offset": True}


@pytest.mark.parametrize("flavour", ["llama", "gpt2", "qwen3", "gemma3"])
@pytest.mark.parametrize("config", ["zero2", "zero2_bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_saved_tensors(tmp_path, flavour, config, checkpointing):
    import torch

    kv = {"n_kv_head": 2} if flavour != "gpt2" else {"n_kv_head": None}
    features = {"qwen3": QWEN3, "gemma3": GEMMA3}.get(flavour, {"flavour": flavour})
    recipe_file = write_recipe(tmp_path, n_layer=3, **features, **kv)
    recipe = load_recipe(recipe_file)
    path = ROOT / "ds_configs" / f"{config}.json"
    ds = load_ds_config(path)
    if checkpointing:  # a memory strategy: the ds_config's section
        ds["activation_checkpointing"] = {"partition_activations": False}
    strategy = resolve(recipe, recipe_file, ds, path, 2)
    est = estimate(recipe, strategy, 1, 2, fused_norms=False)  # torch's RMSNorm on this CPU: the composite path
    formula = next(p.backward for p in est.parts if p.name == "saved for backward")
    dtype = torch.bfloat16 if strategy.precision == "bf16" else torch.float32
    model = recipe.model
    if checkpointing:  # the one block recomputed in the backward is not saved in the forward: add it as measured
        block = saved_tensor_bytes(GPTConfig(**{**model.__dict__, "n_layer": 1}), strategy.micro_batch, 32, dtype)
        plain = saved_tensor_bytes(GPTConfig(**{**model.__dict__, "n_layer": 1}), strategy.micro_batch, 32, dtype, True)
        recompute = block - plain + strategy.micro_batch * 32 * model.d_model * dtype.itemsize
    else:
        recompute = 0
    measured = saved_tensor_bytes(model, strategy.micro_batch, 32, dtype, checkpointing) + recompute
    print(
        f"activations {flavour} {strategy.precision} checkpointing={checkpointing}: formula {formula:,} B, "
        f"saved {measured:,} B ({formula / measured - 1:+.3%})"
    )
    assert abs(formula / measured - 1) < 0.001  # the formula counts what autograd keeps, to a few scalars
