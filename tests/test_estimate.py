"""dstrain estimate: against the tensors 2 ranks really hold, autograd's saved tensors, the ZeRO paper and DeepSpeed."""

import collections
import json
import math
import time

import pytest
import yaml

from dstrain.config import load_recipe
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, num_params
from dstrain.strategy.memory import estimate, estimate_file
from dstrain.strategy.memory_parts import GIB
from dstrain.strategy.param_counts import count_params
from dstrain.strategy.resolve import load_ds_config, resolve

from ranks import run_ranks
from train_helpers import ROOT

LLAMA_7B = ROOT / "recipes" / "llama-7b.yaml"
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
    from dstrain.train import distributed
    from dstrain.train.engine import build_engine, build_model

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
        est = estimate_file(recipe, recipe_file, ROOT / "ds_configs" / f"{name}.json", 1, 2, fused_norms=False)
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
    loss and MLP tiles of dstrain.train.tiling."""
    import deepspeed
    import torch

    from dstrain.model.gpt import GPT, lm_loss
    from dstrain.train import tiling

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
        else:  # SequenceTiledCompute keeps the hidden states and labels on its ctx, out of the hooks' sight
            hidden, labels = model(tokens[:, :-1], head=False), tokens[:, 1:]
            tiling.mean_loss(model.lm_head, model.lm_head.weight, hidden, labels, tiles[0])
            for kept in (hidden, labels):
                saved[kept.untyped_storage().data_ptr()] = kept.untyped_storage().nbytes()
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
    est = estimate_file(recipe, LLAMA_7B, ROOT / "ds_configs" / "zero3_bf16.json", nodes=1, gpus_per_node=8)
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
        est = estimate_file(recipe, LLAMA_7B, ROOT / "ds_configs" / "zero2_bf16.json", nodes, gpus)
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
        est = estimate_file(recipe, LLAMA_7B, path, nodes=1, gpus_per_node=8)
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
        estimate_file(load_recipe(LLAMA_7B), LLAMA_7B, cfg, 1, 8)


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
    sp = estimate_file(recipe, recipe_file, ROOT / "ds_configs" / "sp8_zero3_bf16.json", nodes=1, gpus_per_node=8)
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
    sp = estimate_file(recipe, recipe_file, ROOT / "ds_configs" / "sp8_zero3_bf16.json", nodes=1, gpus_per_node=8)
    assert sp.fits and sp.peak() < 12 * GIB
    fitting = []
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        ds = json.loads(path.read_text())
        if ds.get("sequence_parallel_size", 1) > 1 or ds.get("fp16", {}).get("enabled"):
            continue
        try:
            est = estimate_file(recipe, recipe_file, path, nodes=1, gpus_per_node=8)
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
    est = estimate_file(load_recipe(LLAMA_7B), LLAMA_7B, config, 1, 8)
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
