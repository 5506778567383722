"""The bytes each strategy moves per optimizer step, collective by collective, as DeepSpeed 0.19.8 moves them.

Each ``Traffic`` names the collective the way DeepSpeed's communication logger does (``comms_logger`` in a
ds_config: ``deepspeed.comm.comms_logger.comms_dict``) and counts bytes the way it does: the size of the tensor
handed to the call, per rank, summed over the step's calls. tests/test_plan_traffic.py runs each layout on 2 gloo
ranks with the logger on and checks every collective to 1%. Scalars (the loss, the gradient norm, the overflow
flag: a few bytes each) are not modelled. With Ψ the parameters a rank's model-parallel slice holds, N the ranks
ZeRO partitions over, c the bytes of the communication dtype, b of the model dtype, g the accumulation steps,
T = micro-batch x seq_len / sp the tokens of one micro-batch on a rank and h the model width:

    ZeRO-0, 1   all_reduce  Ψc once per step (the accumulated gradients, in reduce_bucket_size buckets)
    ZeRO-2      all_reduce  Ψc per micro-batch (gradients are reduced into their partitions as they are made)
    ZeRO-1, 2   all_gather_into_tensor  Ψb/N once per step (each rank's updated partition; none when N = 1);
                expert parameters reduce and gather over their expert-data-parallel group of N/ep ranks
    ZeRO-3      reduce_scatter_tensor Ψc per micro-batch; all_gather_into_tensor (Ψ - P)b/N per gather of the
                partitioned parameters, and Pb/N once per step for the P persistent ones (numel at most
                stage3_param_persistence_threshold: gathered after the optimizer updates them, then kept whole).
                DeepSpeed gathers each parameter once per micro-batch when the whole model fits in
                stage3_max_live_parameters and its reuse distance is below stage3_max_reuse_distance (it keeps
                them between the forward and the backward), else once in the forward and once in the backward (an
                upper bound: with stage3_max_live_parameters=1000 the small test model measured 3.6 gathers per
                step, not 4, since the modules at the turn of forward and backward are reused within the distance)
    TP (AutoTP) all_reduce  Thb per block and micro-batch: 2 in the forward (o_proj, down_proj outputs), one per
                column-parallel projection in the backward (q, k, v, up, and gate for llama: their input grads)
    PP (1F1B)   send and recv Thb per micro-batch on every stage (activations one way, their gradients back)
    SP          all_to_all_single per block and micro-batch: q, k, v and the context in the forward, their
                gradients in the backward (Ulysses)
    EP          all_to_all_single per MoE layer and micro-batch: dispatch and combine in the forward and backward
                (and in the recompute, with activation checkpointing), k·T tokens padded to the busiest expert
                (dropless: the planner assumes balanced routing, the test measures the run's imbalance)

The ZeRO all-reduce runs over the data-parallel group (and the sequence-parallel ranks); expert parameters reduce
over their expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dstrain.config import Recipe
from dstrain.plan.param_counts import ParamCounts
from dstrain.precision import Precision
from dstrain.strategy.parallel import kv_replicas
from dstrain.strategy.resolve import Strategy

# What each collective puts on the wire per rank, per logged byte, in a ring of n ranks (nccl-tests' bus bandwidth):
# DeepSpeed logs an all-gather's input (one rank's shard) but a reduce-scatter's input (the whole tensor).
WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: n - 1,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # a recv's bytes are its peer's send
    "batch_isend_irecv": lambda n: 0.5,  # DualPipeV's sends and receives, logged as one batch: half are sent
}


@dataclass(frozen=True)
class Traffic:
    op: str  # the collective, as DeepSpeed's comms logger names it
    group: str  # "dp" (ZeRO's partitions), "tp", "pp", "sp" or "ep"
    group_size: int
    logged_bytes: int  # per rank per optimizer step, as the comms logger counts them
    what: str  # what is moved
    overlapped: bool  # the engine runs it behind computation (an assumption the time model states)

    @property
    def wire_bytes(self) -> float:
        return self.logged_bytes * WIRE[self.op](self.group_size) if self.group_size > 1 else 0.0


def dtype_bytes(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


def comm_bytes(strategy: Strategy) -> int:
    """Bytes per gradient element on the wire: communication_data_type, else the model's dtype."""
    kind = strategy.deepspeed_config.get("communication_data_type")
    return {"fp32": 4, "fp16": 2, "bf16": 2}.get(kind or "", dtype_bytes(strategy.precision))


def step_traffic(
    recipe: Recipe, strategy: Strategy, counts: ParamCounts, expert_params: int = 0, imbalance: float = 1.0
) -> list[Traffic]:
    """Every bulk collective of one optimizer step on one rank (the busiest pipeline stage: counts.per_rank).
    ``imbalance``: the busiest expert's tokens over the mean (dstrain's MoE is dropless: DeepSpeed's all-to-all
    buffers hold num_experts x the busiest expert's count); 1.0 = balanced routing, the planner's assumption."""
    if recipe.lora is None:
        zero = zero_traffic(strategy, counts, expert_params)
    else:
        zero = adapter_traffic(recipe, strategy, counts)
    return [t for t in zero + model_parallel_traffic(recipe, strategy, imbalance) if t.logged_bytes > 0]


def adapter_traffic(recipe: Recipe, strategy: Strategy, counts: ParamCounts) -> list[Traffic]:
    """With recipe.lora only the adapters' gradients are reduced and their partitions gathered; ZeRO-3 also gathers
    the frozen base (its NF4 bytes under QLoRA) as for a full model: once a micro-batch or twice."""
    from dstrain.plan.adapter_costs import adapter_counts

    s, n, g = strategy.zero_stage, strategy.zero_partitions, strategy.grad_accum
    zero = strategy.deepspeed_config.get("zero_optimization", {})
    threshold = zero.get("stage3_param_persistence_threshold", 100_000) if s == 3 else 0
    adapter = adapter_counts(recipe, counts, strategy.pp_stages, threshold)
    trained = zero_traffic(strategy, replace(counts, per_rank=adapter.trainable, persistent=adapter.persistent))
    if s < 3:
        return trained
    base = dtype_bytes(strategy.precision) * adapter.frozen + adapter.quantized_bytes
    gathers = g * (1 if keeps_gathered(zero, counts.per_rank) else 2)
    what = "frozen base" + (" (NF4)" if adapter.quantized else "")
    return trained + [Traffic("all_gather_into_tensor", "dp", n, gathers * _ceil_div(base, n), what, True)]


def zero_traffic(strategy: Strategy, counts: ParamCounts, expert_params: int = 0) -> list[Traffic]:
    s, n, g = strategy.zero_stage, strategy.zero_partitions, strategy.grad_accum
    psi, b, c = counts.per_rank, dtype_bytes(strategy.precision), comm_bytes(strategy)
    zero = strategy.deepspeed_config.get("zero_optimization", {})
    overlap = bool(zero.get("overlap_comm", s == 3))
    if s == 3:
        persistent = counts.persistent
        gathers = g * (1 if keeps_gathered(zero, psi) else 2)
        gathered = gathers * _ceil_div(psi - persistent, n) + _ceil_div(persistent, n)
        return [
            Traffic("reduce_scatter_tensor", "dp", n, g * psi * c, "gradients into their partitions", overlap),
            Traffic("all_gather_into_tensor", "dp", n, gathered * b, "parameters", True),
        ]
    reductions = g if s == 2 else 1
    dense = psi - expert_params
    parts = [Traffic("all_reduce", "dp", n, reductions * dense * c, "gradients", overlap and s == 2)]
    if expert_params:
        parts.append(
            Traffic(
                "all_reduce", "edp", n // strategy.ep_size, reductions * expert_params * c, "expert gradients", False
            )
        )
    if s > 0 and n > 1:
        parts.append(
            Traffic("all_gather_into_tensor", "dp", n, _ceil_div(dense, n) * b, "updated parameter partitions", False)
        )
    edp = n // strategy.ep_size
    if s > 0 and expert_params and edp > 1:
        parts.append(
            Traffic("all_gather_into_tensor", "edp", edp, _ceil_div(expert_params, edp) * b, "updated experts", False)
        )
    return parts


def keeps_gathered(zero: dict, psi: int) -> bool:
    """ZeRO-3 keeps a gathered parameter for its reuse in the backward when the model fits the live budget."""
    live = float(zero.get("stage3_max_live_parameters", 1e9))
    reuse = float(zero.get("stage3_max_reuse_distance", 1e9))
    return psi <= live and psi <= reuse


def model_parallel_traffic(recipe: Recipe, strategy: Strategy, imbalance: float = 1.0) -> list[Traffic]:
    m, g, b = recipe.model, strategy.grad_accum, dtype_bytes(strategy.precision)
    tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    act = tokens * m.d_model * b  # one micro-batch's hidden states on a rank
    recompute = 2 if strategy.activation_checkpointing else 1  # a recomputed forward repeats its collectives
    parts = []
    if strategy.tp_size > 1:
        backward = 5 if m.flavour == "llama" else 4  # q, k, v, up (+ gate): one input-gradient all-reduce each
        per_block = (2 * recompute + backward) * act
        parts.append(Traffic("all_reduce", "tp", strategy.tp_size, g * m.n_layer * per_block, "block outputs", False))
    if strategy.pp_stages > 1:
        what = "activations and their gradients"
        if strategy.pipe_schedule == "dualpipev":
            # Every rank hands each micro-batch on in both phases (rank 0 sends activations out and receives them
            # back, then the same for their gradients): twice 1F1B's bytes each way, in batch_isend_irecv calls.
            parts.append(Traffic("batch_isend_irecv", "pp", strategy.pp_stages, 4 * g * act, what, False))
        else:
            parts += [Traffic(op, "pp", strategy.pp_stages, g * act, what, False) for op in ("send", "recv")]
    if strategy.sp_size > 1:
        kv = m.kv_heads * kv_replicas(m.n_head, m.kv_heads, strategy.sp_size)  # repeated beyond the kv heads
        qkvo = tokens * (2 * m.d_model + 2 * kv * m.head_dim) * b
        parts.append(
            Traffic("all_to_all_single", "sp", strategy.sp_size, g * m.n_layer * 2 * recompute * qkvo, "q, k, v", False)
        )
    if strategy.ep_size > 1 and m.moe is not None:
        routed = tokens * m.moe.top_k * imbalance * m.d_model * b  # num_experts x capacity x d_model
        per_layer = round((2 * recompute + 2) * routed)  # dispatch and combine, forward(s) and backward
        parts.append(
            Traffic("all_to_all_single", "ep", strategy.ep_size, g * m.n_moe_layers * per_layer, "tokens", False)
        )
    return parts


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
