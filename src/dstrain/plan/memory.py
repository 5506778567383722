"""The memory model behind ``dstrain estimate``: what each rank holds under a ds_config, per phase of a step.

Model states, per rank, with Ψ the parameters this rank's model-parallel slice holds, N the data-parallel size and b
the bytes of the model's dtype (4 fp32, 2 bf16/fp16). These are the tensors DeepSpeed 0.19.8 really keeps;
tests/test_estimate.py counts them on 2 ranks and checks the totals:

    stage  parameters          gradients (backward | step)          fp32 master   Adam moments
    0      bΨ                  bΨ | bΨ (fp32), 4Ψ (fp16)            0 / 4Ψ fp16   8Ψ
    1      bΨ                  bΨ | (b+4)Ψ/N                        4Ψ/N          8Ψ/N
    2      bΨ                  bΨ/N | (b+4)Ψ/N                      4Ψ/N          8Ψ/N
    3      b(Ψ/N + P) | bΨ/N   bΨ/N | bΨ/N + 4·min(Ψ/N, S)          4Ψ/N          8Ψ/N

    bf16 (gradients summed in fp32, which dstrain requires of every bf16 ds_config):
    1      2Ψ                  2Ψ + 4Ψ (BF16_Optimizer's whole fp32 accumulation buffer)    4Ψ/N   8Ψ/N
    2      2Ψ                  4Ψ/N (the fp32 partition the optimizer reads)                4Ψ/N   8Ψ/N
    3      2(Ψ/N + P) | 2Ψ/N   4Ψ/N | 4Ψ/N + 4·min(Ψ/N, S)                                 4Ψ/N   8Ψ/N

"backward" is the last backward of a step, "step" the optimizer step: the reduced gradient partition is copied to
fp32 for the optimizer (even in fp32, where the copy is a second fp32 buffer); ZeRO-3 copies one sub-group of S =
zero_optimization.sub_group_size elements at a time. ZeRO-1 accumulates full gradients in ``param.grad`` between
steps; ZeRO-1/2/3 keep an fp32 master partition even for fp32 models (only ZeRO-0 fp32 updates the module's own
weights). P are ZeRO-3's persistent parameters (numel <= stage3_param_persistence_threshold), whole on every rank
during the backward. DeepSpeed's own ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` assume 16-bit gradients (and omit the fp32 copy, as does the ZeRO paper's
(2+2+12)Ψ/N); both are reported next to ours. Optimizer offload moves the master partition, the Adam moments and the
fp32 gradient partition (plus a 16-bit staging copy, and a 16-bit accumulation buffer when accumulating) to the CPU;
parameter offload moves ZeRO-3's partitions.

Activations per rank: what autograd saves for the backward (tests/test_estimate.py checks it with saved-tensor
hooks), term by term in dstrain.plan.activations. Sequence parallelism (sp) divides them by sp (each rank holds
L/sp tokens; attention holds L tokens of heads/sp heads) and partitions the model states over N = dp x sp ranks.
train.averaging's fp32 copies of the weights: dstrain.plan.averaging_memory (4·(E + L)·Ψ or Ψ/N).
An objective's pass before step 1 (its memory term: the preference objective's reference pass) is a phase of its own:
dstrain.plan.reference_memory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.model.counts import num_params
from dstrain.objectives.registry import objective_of
from dstrain.plan.activations import (
    activation_bytes,
    host_checkpoint_bytes,
    mlp_tile_bytes,
    sp_exchange_bytes,
)
from dstrain.plan.averaging_memory import averaging_parts
from dstrain.plan.memory_parts import GIB, Estimate, Part
from dstrain.plan.param_counts import MOE_FORMULA, ParamCounts, count_params, meta_shapes, moe_activation_bytes
from dstrain.plan.reference_memory import at_rest, reference_parts
from dstrain.strategy.resolve import Strategy, load_ds_config, resolve

if TYPE_CHECKING:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig


def estimate(
    recipe: Recipe,
    strategy: Strategy,
    nodes: int,
    gpus_per_node: int,
    device_memory_gib: float = 80.0,
    reserve_gib: float = 1.0,
    fused_norms: bool = True,
) -> Estimate:
    """What each rank holds; ``fused_norms``: the devices run torch's fused RMSNorm (a GPU), not its CPU path."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**strategy.ds_config.get("zero_optimization", {}))  # DeepSpeed's own defaults
    stage, n = strategy.zero_stage, strategy.zero_partitions
    if (strategy.offload_optimizer or strategy.offload_param) and stage == 0:
        raise DstrainError(
            f"{strategy.source}: zero_optimization.offload_* needs ZeRO stage 1, 2 or 3; set zero_optimization.stage"
        )
    method = str(strategy.ds_config.get("pipeline", {}).get("partition_method", "parameters")).lower()
    threshold = zero.param_persistence_threshold if stage == 3 else 0
    counts = count_params(
        recipe.model, strategy.tp_size, strategy.pp_stages, threshold, method, strategy.ep_size, strategy.pipe_schedule
    )
    est = Estimate(
        *(recipe.name, strategy.source, nodes, gpus_per_node, stage, strategy.precision, strategy.micro_batch),
        *(strategy.grad_accum, strategy.dp_size, strategy.tp_size, strategy.pp_stages, strategy.offload_optimizer),
        *(strategy.offload_param, counts.total, counts.per_rank, int(device_memory_gib * GIB), int(reserve_gib * GIB)),
        ep_size=strategy.ep_size,
        params_active=num_params(recipe.model, active=True) if recipe.model.moe is not None else None,
    )
    persistent = min(counts.persistent, zero.model_persistence_threshold // n) if stage == 3 else 0
    # Expert parallelism: E/ep experts held, partitioned over N/ep expert-data-parallel ranks: the share is total/N.
    part = math.ceil(counts.total / n) if strategy.ep_size > 1 else None
    muon = muon_params(recipe.model) if recipe.optim.kind == "muon" else 0  # accepted on plain data parallelism only
    est.parts = model_state_parts(strategy, counts.per_rank, persistent, part, muon)
    est.parts += averaging_parts(recipe.train.averaging, strategy, counts.per_rank)
    est.parts += activation_parts(recipe, strategy, fused_norms)
    if recipe.model.moe is not None:
        tokens, recompute = strategy.micro_batch * recipe.data.seq_len, strategy.activation_checkpointing
        moe_bytes = moe_activation_bytes(recipe.model, tokens, strategy.precision, recompute)
        formula = MOE_FORMULA.replace("n_moe", "1") if recompute else MOE_FORMULA
        est.parts.append(Part("activations", "MoE experts and all-to-all buffers", "device", moe_bytes, 0, formula))
    est.parts += buffer_parts(strategy, zero, counts)
    if strategy.sp_size > 1:
        size = sp_exchange_bytes(recipe, strategy)
        est.parts.append(Part("buffers", "Ulysses all-to-all (q, k, v)", "device", size, 0, "2a·(T/sp)·(d + 2·kv)"))
    est.sp_size = strategy.sp_size
    if (before_training := objective_of(recipe).memory(recipe)) is not None:  # the objective's memory term
        est.reference_pass = True
        at_rest(est.parts, stage)
        est.parts += reference_parts(before_training, recipe, strategy)
    est.deepspeed_reference = deepspeed_reference(counts, est)
    return est


def activation_parts(recipe: Recipe, strategy: Strategy, fused_norms: bool) -> list[Part]:
    """Saved for the backward, the loss's logits (whole, or one tile of the chunked loss), a tiled MLP's tile."""
    saved, logits = activation_bytes(recipe, strategy, fused_norms)
    host = host_checkpoint_bytes(recipe, strategy)  # of the block inputs counted in `saved`
    parts = [Part("activations", "saved for backward", "device", saved - host, 0, "see module docstring")]
    if host:
        name = "checkpointed block inputs, pinned on the host"
        parts.append(Part("activations", name, "cpu", host, host, "(layers - 1)·a·T·d"))
    n = strategy.loss_tiles
    if n == 1:
        parts.append(Part("activations", "logits gradient (backward start)", "device", logits, 0, "8·T·V"))
    else:
        name = f"chunked loss: 1 of {n} chunks' logits, head gradients (forward end)"
        parts.append(Part("activations", name, "device", logits, 0, "12·(T/n)·V + a·T·d + (4 + a)·V·d"))
    if strategy.mlp_tiles > 1:
        name = f"MLP: 1 of {strategy.mlp_tiles} tiles recomputed (backward)"
        tile = mlp_tile_bytes(recipe, strategy)
        parts.append(Part("activations", name, "device", tile, 0, "2a·(T/m)·MLP intermediates + a·T·d"))
    return parts


def model_state_parts(
    strategy: Strategy, psi: int, persistent: int, part: int | None = None, muon: int = 0
) -> list[Part]:
    """Parameters, gradients and optimizer states per rank (module docstring); ``part``: a ZeRO share other than Ψ/N;
    ``muon``: parameters Muon takes (one fp32 momentum each instead of two Adam moments: whole at ZeRO-0, else
    partitioned like the master weights, and ZeRO-1/2 fp32 keep a staged copy: stage_1_and_2._muon_staging_momentum)."""
    s, n, dtype = strategy.zero_stage, strategy.zero_partitions, strategy.precision
    b = 4 if dtype == "fp32" else 2
    opt, par = strategy.offload_optimizer, strategy.offload_param
    part = part or math.ceil(psi / n)
    parts: list[Part] = []
    if s < 3:
        parts.append(Part("parameters", f"parameters ({dtype})", "device", b * psi, b * psi, f"{b}Ψ"))
    else:
        parts.append(
            Part("parameters", f"parameters ({dtype}), 1/{n} partition", par or "device", b * part, b * part, f"{b}Ψ/N")
        )
        parts.append(
            Part("parameters", "persistent parameters, whole", "device", b * persistent, 0, f"{b}P (backward only)")
        )
    parts += gradient_parts(strategy, psi, part)
    if opt and s < 3:
        parts.append(
            Part("parameters", f"{dtype} staging of the updated partition", "cpu", b * part, b * part, f"{b}Ψ/N")
        )
    share, label = (psi, "Ψ") if s == 0 and not bf16_optimizer(strategy) else (part, "Ψ/N")
    if s > 0 or b != 4:  # only ZeRO-0 fp32 updates the module's own weights
        parts.append(
            Part("optimizer states", "fp32 master weights", opt or "device", 4 * share, 4 * share, f"4{label}")
        )
    if muon:
        muon, of = (muon, "") if share == psi else (math.ceil(muon / n), "/N")
        adam = share - muon
        parts.append(Part("optimizer states", "Adam moments (fp32)", "device", 8 * adam, 8 * adam, f"8(Ψ-M){of}"))
        m = 4 * muon * (2 if s in (1, 2) and not bf16_optimizer(strategy) else 1)  # ZeRO-1/2: and a staged copy
        parts.append(Part("optimizer states", "Muon momentum (fp32)", "device", m, m, f"{m // muon}M{of}"))
        return parts
    parts.append(Part("optimizer states", "Adam moments (fp32)", opt or "device", 8 * share, 8 * share, f"8{label}"))
    return parts


def muon_params(model_config) -> int:
    """M: the parameters Muon takes, by DeepSpeed's rule (deepspeed.set_optimizer_flags): 2 or more dimensions and
    neither "embed" nor "lm_head" in the name."""
    hidden = ("embed", "lm_head")
    shapes = meta_shapes(model_config)
    return sum(math.prod(s) for n, s in shapes if len(s) >= 2 and not any(k in n for k in hidden))


def bf16_optimizer(strategy: Strategy) -> bool:
    """DeepSpeed runs its BF16_Optimizer (whole fp32 accumulation buffer, partitioned fp32 state): bf16 at ZeRO-1
    accumulating in fp32 without offload, or a ZeRO-0 bf16 pipeline (engine._do_optimizer_sanity_check)."""
    if strategy.precision != "bf16" or strategy.offload_optimizer:
        return False
    return (
        strategy.zero_stage == 1
        and accumulates_in_fp32(strategy)
        or (strategy.zero_stage == 0 and strategy.pp_stages > 1)
    )


def accumulates_in_fp32(strategy: Strategy) -> bool:
    return strategy.ds_config.get("data_types", {}).get("grad_accum_dtype") == "fp32"


def gradient_parts(strategy: Strategy, psi: int, part: int | None = None) -> list[Part]:
    """Gradients per rank; "backward" is the last backward of a step, "step" the optimizer step."""
    s, n, dtype, opt = strategy.zero_stage, strategy.zero_partitions, strategy.precision, strategy.offload_optimizer
    b = 4 if dtype == "fp32" else 2
    g = 4 if accumulates_in_fp32(strategy) else b  # bytes of an accumulated gradient
    part = part or math.ceil(psi / n)
    if bf16_optimizer(strategy):
        return [
            Part("gradients", "gradients (bf16), whole", "device", 2 * psi, 2 * psi, "2Ψ"),
            Part("gradients", "fp32 accumulation buffer, whole", "device", 4 * psi, 4 * psi, "4Ψ"),
        ]
    if s == 0:  # torch's optimizer reads param.grad; mixed precision first copies it to fp32 (16-bit grads freed)
        whole = [Part("gradients", f"gradients ({dtype})", "device", b * psi, b * psi if b == 4 else 0, f"{b}Ψ")]
        copy = [Part("gradients", "gradients (fp32 copy for the optimizer)", "device", 0, 4 * psi, "4Ψ at the step")]
        return whole + (copy if b != 4 else [])
    name = f"gradients ({'fp32' if g == 4 else dtype})"
    if opt:  # stage 1/2 stream gradients to the CPU; stage 3 keeps its gradient partition on the device
        if s == 3:
            parts = [Part("gradients", f"{name}, 1/{n} partition", "device", g * part, g * part, f"{g}Ψ/N")]
        elif strategy.grad_accum > 1:
            parts = [Part("gradients", f"gradient accumulation ({dtype})", "cpu", b * part, b * part, f"{b}Ψ/N")]
        else:
            parts = []
    elif s == 1:
        parts = [
            Part("gradients", f"gradients ({dtype}), accumulated whole", "device", b * psi, 0, f"{b}Ψ (backward)"),
            Part("gradients", f"gradients ({dtype}), reduced 1/{n} partition", "device", 0, b * part, f"{b}Ψ/N (step)"),
        ]
    else:
        parts = [Part("gradients", f"{name}, 1/{n} partition", "device", g * part, g * part, f"{g}Ψ/N")]
    if s == 2 and g == 4 and b == 2 and not opt:
        return parts  # the fp32 partition is what the optimizer reads: no copy
    if opt == "nvme":  # ZeRO-Infinity writes the fp32 gradients to disk; the step reads them into its swap buffers
        return parts + [
            Part("gradients", "gradients (fp32), swapped for the optimizer", "nvme", 4 * part, 4 * part, "4Ψ/N")
        ]
    # ZeRO-3 steps one sub-group (zero_optimization.sub_group_size elements) at a time, each with its fp32 copy.
    copied = min(part, int(strategy.ds_config["zero_optimization"].get("sub_group_size", 1e9))) if s == 3 else part
    keep = 4 * part if opt else 0  # offload keeps the pinned fp32 gradient partition allocated
    formula = "4·min(Ψ/N, sub_group_size) at the step" if s == 3 else "4Ψ/N at the step"
    return parts + [
        Part(
            "gradients",
            "gradients (fp32 copy for the optimizer)",
            "cpu" if opt else "device",
            keep,
            4 * copied,
            formula,
        )
    ]


def buffer_parts(strategy: Strategy, zero: DeepSpeedZeroConfig, counts: ParamCounts) -> list[Part]:
    """Communication buckets, ZeRO-3's gathered working set, offload staging: sizes from the ds_config."""
    s, b, psi = strategy.zero_stage, 4 if strategy.precision == "fp32" else 2, counts.per_rank
    opt, par = strategy.offload_optimizer, strategy.offload_param
    parts: list[Part] = []
    if s == 0:
        from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

        flat = b * min(psi, MEMORY_OPT_ALLREDUCE_SIZE)
        parts.append(Part("buffers", "flattened all-reduce bucket", "device", flat, 0, "b·min(Ψ, 5e8)"))
    elif s < 3 and zero.contiguous_gradients:
        count = 2 if zero.overlap_comm else 1
        size = count * b * zero.reduce_bucket_size
        parts.append(Part("buffers", f"{count} x reduce bucket", "device", size, 0, "b·reduce_bucket_size"))
    if s == 3:
        size = b * zero.reduce_bucket_size
        parts.append(Part("buffers", "reduce bucket", "device", size, size, "b·reduce_bucket_size"))
        gathered = b * zero.prefetch_bucket_size + 2 * b * counts.largest_layer
        parts.append(
            Part(
                "buffers",
                "prefetch bucket + largest layer, gathered",
                "device",
                gathered,
                0,
                "b·prefetch_bucket_size + 2b·largest layer",
            )
        )
    if par == "nvme":
        pinned = zero.offload_param.buffer_count * zero.offload_param.buffer_size * b
        parts.append(
            Part("buffers", "NVMe parameter swap buffers (pinned)", "cpu", pinned, pinned, "buffer_count·buffer_size·b")
        )
    if opt == "nvme":
        pinned = (
            zero.offload_optimizer.buffer_count
            * min(zero.sub_group_size, math.ceil(psi / strategy.zero_partitions))
            * 4
        )
        parts.append(
            Part(
                "buffers",
                "NVMe optimizer swap buffers (pinned)",
                "cpu",
                pinned,
                pinned,
                "buffer_count·min(sub_group_size, Ψ/N)·4",
            )
        )
    if opt and s < 3:
        size = b * counts.largest_param
        parts += [
            Part("buffers", "offload staging (largest parameter)", where, size, size, "b·largest")
            for where in ("device", "cpu")
        ]
    return parts


def deepspeed_reference(counts: ParamCounts, est: Estimate) -> dict | None:
    """DeepSpeed's own model-state estimators (mixed precision, no model parallelism): device and CPU per node."""
    if est.zero_stage < 2 or est.tp_size * est.pp_stages > 1:
        return None
    if est.zero_stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            counts.total,
            est.gpus_per_node,
            est.nodes,
            cpu_offload=bool(est.offload_optimizer),
            additional_buffer_factor=1.0,
        )
        name = "stage_1_and_2.estimate_zero2_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            counts.total,
            counts.largest_layer,
            est.gpus_per_node,
            est.nodes,
            cpu_offload=bool(est.offload_optimizer),
            cpu_offload_params=bool(est.offload_param),
            zero_init=True,
            additional_buffer_factor=1.0,
        )
        name = "stage3.estimate_zero3_model_states_mem_needs"
    return {"function": name, "device": int(gpu), "cpu_per_node": int(cpu)}


def estimate_file(
    recipe: Recipe,
    recipe_file: str | Path,
    ds_file: str | Path,
    nodes: int,
    gpus_per_node: int,
    device_memory_gib: float = 80.0,
    reserve_gib: float = 1.0,
    fused_norms: bool = True,
) -> Estimate:
    """Resolve ``ds_file`` against the recipe for nodes x gpus_per_node ranks, then estimate."""
    if nodes < 1 or gpus_per_node < 1:
        raise DstrainError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be at least 1")
    # The estimate is for the cluster's devices, not this host's: its fp16 support does not matter.
    strategy = resolve(recipe, recipe_file, load_ds_config(ds_file), ds_file, nodes * gpus_per_node, check_device=False)
    return estimate(recipe, strategy, nodes, gpus_per_node, device_memory_gib, reserve_gib, fused_norms)
