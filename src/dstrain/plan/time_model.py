"""The step-time model behind ``dstrain plan``: compute, communication, pipeline bubble and offload per step.

Stated assumptions (each replaceable, each named in the plan's output):

- Compute: the trainer's FLOPs per token (dstrain.model.counts.flops_per_token, 6N + 12·layers·d·seq) times the
  tokens a rank processes, over ``Device.efficiency`` x peak, scaled by T / (T + half_tokens) for a micro-batch of T
  tokens per rank (small matmuls run below the device's best rate), plus a fixed cost per micro-batch
  (``Device.micro_batch_overhead_s``); +1/3 of the FLOPs with activation checkpointing (the forward runs
  twice); under tensor parallelism the replicated output head is computed on every TP rank; tiling's recompute
  (layout_costs.tiled_mlp_recompute: the tiled MLPs' forward; the chunked loss recomputes nothing, it forms the head's
  gradients in its forward: dstrain.model.chunked_loss).
  ``dstrain plan --calibrate`` measures the rate and the fixed cost on this machine instead.
- Communication: the bytes of dstrain.plan.traffic (checked against DeepSpeed's comms logger) over the
  bandwidth of the group that carries them: intra-node when the group's ranks share a node, inter-node otherwise.
  Ranks are laid out tensor-, then sequence-, then data-parallel innermost, pipeline stages outermost.
- Overlap: on devices with communication streams (not a CPU, where gloo runs each collective inline), ZeRO-3's
  parameter gathers and, with overlap_comm, ZeRO-2/3's gradient reductions run behind the backward (only what
  exceeds the compute they hide behind is exposed); ZeRO-0/1's all-reduce after the last backward, the updated
  partitions' all-gather, TP's, SP's and EP's collectives and the pipeline's sends are on the critical path.
- Pipeline: the bubble of DeepSpeed's own schedule (1F1B or DualPipeV) simulated with a backward of twice the
  forward (plan.bubble; for 1F1B that is (stages - 1) / accumulation steps of the compute).
- Engine (calibrated devices only: dstrain compare --plan, commands/calibrate_engine.py): DeepSpeed's own seconds per
  step and per micro-batch of each engine kind, and what a TP or an SP group adds per micro-batch and per sample
  beyond its collectives' bytes (per-call latency, AutoTP's and Ulysses' copies). A datasheet device has neither.
- Offload: the optimizer's partition crosses the host link twice per step (gradients down, parameters up) and
  DeepSpeed's CPU Adam updates it at ``Device.cpu_adam_params_per_s``; ZeRO-3 parameter offload brings every
  parameter up once per forward and backward. Not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dstrain.config import Recipe
from dstrain.devices import datasheet_peaks
from dstrain.model.counts import flops_per_token
from dstrain.plan import layout_costs
from dstrain.plan.param_counts import ParamCounts, count_params
from dstrain.plan.traffic import Traffic, step_traffic
from dstrain.precision import Precision
from dstrain.strategy.resolve import Strategy

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Device:
    """What the time model knows of one accelerator kind and the links between them."""

    name: str
    memory_gib: float  # usable memory per device
    peak_tflops: dict  # precision -> dense TFLOP/s (datasheet)
    efficiency: float  # fraction of peak a large training matmul reaches (the model's ceiling on MFU)
    half_tokens: int  # tokens per matmul at which half of that efficiency is reached
    intra_node_gbps: float  # Gbit/s per device between devices of one node (bus bandwidth)
    inter_node_gbps: float  # Gbit/s per device between nodes
    host_gbps: float  # Gbit/s between a device and its host memory (offload)
    cpu_adam_params_per_s: float  # DeepSpeed's CPU Adam: parameters updated per second for one device's share
    host_memory_gib: float = 2048.0  # host memory of one node (a DGX H100 or A100 node: 2 TiB), for offloaded state
    micro_batch_overhead_s: float = 0.0  # fixed seconds of each micro-batch's forward + backward (launches, hooks)
    overlaps_communication: bool = True  # collectives on their own streams; False on a CPU (gloo runs them inline)
    # (engine kind, seconds per step, seconds per micro-batch) DeepSpeed's engine adds beyond the model's compute and
    # collectives; measured by dstrain compare --plan (commands/calibrate_engine.py), none for a datasheet device
    engine_costs: tuple[tuple[str, float, float], ...] = ()
    # ("tp" or "sp", seconds per micro-batch, seconds per sample of it) a TP or SP group of 2 adds beyond its ZeRO
    # stage's engine and the bytes of its collectives: per-call latency, AutoTP's and Ulysses' copies; measured by
    # dstrain compare --plan (commands/calibrate_engine.py), none for a datasheet device
    parallel_costs: tuple[tuple[str, float, float], ...] = ()
    # seconds one ZeRO-3 module fetch adds on the critical path whatever its bytes (the pre-forward hook, the
    # all-gather's launch and its wait: prefetching hides bytes, not calls); 30 µs is the order of NCCL's small
    # all-gather latency within a node (nccl-tests) beside DeepSpeed's hook; 0 where engine_costs were measured
    module_fetch_s: float = 30e-6

    def engine_seconds(self, kind: str, micro_batches: int) -> float:
        for name, per_step, per_micro in self.engine_costs:
            if name == kind:
                return per_step + micro_batches * per_micro
        return 0.0

    def parallel_seconds(self, strategy: Strategy) -> float:
        sizes = {"tp": strategy.tp_size, "sp": strategy.sp_size}
        return sum(
            strategy.grad_accum * (per_micro + strategy.micro_batch * per_sample)
            for kind, per_micro, per_sample in self.parallel_costs
            if sizes[kind] > 1
        )

    def rate(self, precision: Precision, tokens: int) -> float:
        """FLOP/s reached by a matmul of ``tokens`` rows."""
        peak = self.peak_tflops.get(precision) or self.peak_tflops["fp32"]
        return peak * 1e12 * self.efficiency * tokens / (tokens + self.half_tokens)


# Efficiency 0.6 is the fraction of the bf16 peak large GEMMs sustain in training on H100 SXM (Megatron-LM reports
# 41-48% MFU end to end); NVLink 4 all-reduce bus bandwidth ~360 GB/s; one 400 Gbit/s NDR NIC per GPU; PCIe 5 x16.
DEVICES = {
    "h100-sxm": Device("h100-sxm", 80, datasheet_peaks("H100 SXM"), 0.5, 512, 2880, 360, 400, 1e9),
    "a100-80gb": Device("a100-80gb", 80, datasheet_peaks("A100 80GB"), 0.5, 512, 2000, 180, 200, 5e8),
}


@dataclass
class Prediction:
    compute_s: float  # forward + backward (+ recompute) of this rank's share
    comm_s: dict[str, float] = field(default_factory=dict)  # exposed seconds per named collective
    # seconds per layout part besides compute and communication (dstrain.plan.layout_costs, by the part's name)
    layout_s: dict[str, float] = field(default_factory=dict)
    engine_s: float = 0.0  # DeepSpeed's own time (calibrated only): hooks, bucketing, the pipeline's instruction loop

    @property
    def bubble_s(self) -> float:
        return self.layout_s.get("pipeline", 0.0)

    @property
    def offload_s(self) -> float:
        """Host traffic: the offloaded states' and the host checkpoints' (every layout part's seconds but the
        pipeline's bubble)."""
        return sum(self.layout_s.values()) - self.bubble_s

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values()) + sum(self.layout_s.values()) + self.engine_s

    @property
    def bound(self) -> str:
        """What the step spends most of its time on."""
        parts = {"compute": self.compute_s, "pipeline bubble": self.bubble_s, "offload traffic": self.offload_s}
        parts["engine overhead"] = self.engine_s
        parts.update(self.comm_s)
        return max(parts, key=lambda k: parts[k])


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int
    gpus_per_node: int

    def bandwidth(self, group: str, strategy: Strategy) -> float:
        """Bytes/s per device of a group: intra-node when its ranks share a node (tp innermost, then sp, dp, ep;
        pipeline stages outermost)."""
        inner = {"tp": 1, "sp": strategy.tp_size, "ep": strategy.tp_size * strategy.sp_size}
        inner.update(dp=inner["ep"], edp=inner["ep"] * strategy.ep_size)
        size = {
            "tp": strategy.tp_size,
            "sp": strategy.sp_size,
            "dp": strategy.zero_partitions // strategy.sp_size,
            "ep": strategy.ep_size,
            "edp": strategy.dp_size // strategy.ep_size,
        }
        if group == "pp":
            span = strategy.tp_size * strategy.sp_size * strategy.dp_size * strategy.pp_stages
        else:
            span = inner[group] * size[group]
        gbps = self.device.intra_node_gbps if span <= self.gpus_per_node else self.device.inter_node_gbps
        return gbps * GBIT


def predict(recipe: Recipe, strategy: Strategy, counts: ParamCounts, cluster: Cluster) -> Prediction:
    """Seconds of one optimizer step of ``strategy`` on ``cluster`` (module docstring)."""
    world = cluster.nodes * cluster.gpus_per_node
    tokens_step = recipe.train.global_batch * recipe.data.seq_len
    per_token, backward_share = train_flops_per_token(recipe)
    flops = layout_costs.with_flops(recipe, strategy, per_token * tokens_step / world)
    matmul_tokens = strategy.micro_batch * recipe.data.seq_len // strategy.sp_size
    overhead = strategy.grad_accum * cluster.device.micro_batch_overhead_s
    pred = Prediction(compute_s=flops / cluster.device.rate(strategy.precision, matmul_tokens) + overhead)
    backward_s = pred.compute_s * backward_share
    hidden = 0.0  # overlapped communication, hidden behind the backward
    for t in step_traffic(recipe, strategy, counts, expert_share(recipe, strategy, counts)):
        seconds = t.wire_bytes / cluster.bandwidth(t.group, strategy)
        name = f"{t.op} ({t.group})"
        if t.overlapped and cluster.device.overlaps_communication:
            hidden += seconds
            continue
        pred.comm_s[name] = pred.comm_s.get(name, 0.0) + seconds
    if hidden > backward_s:
        pred.comm_s["overlapped collectives (exposed)"] = hidden - backward_s
    # Charged with a frozen base only (recipe.lora), where ZeRO-3's gathers are all it adds over ZeRO-2 and ties are
    # the rule; full-model plans leave it out until their shipped ds_configs/planned are planned again with it.
    if strategy.zero_stage == 3 and cluster.device.module_fetch_s and recipe.lora is not None:
        pred.comm_s["ZeRO-3 module fetches"] = zero3_fetches(recipe, strategy) * cluster.device.module_fetch_s
    pred.layout_s = layout_costs.seconds(recipe, strategy, counts, cluster.device, pred.compute_s)
    engine_s = cluster.device.engine_seconds(engine_kind(strategy), strategy.grad_accum)
    pred.engine_s = engine_s + cluster.device.parallel_seconds(strategy)
    return pred


def train_flops_per_token(recipe: Recipe) -> tuple[float, float]:
    """Training FLOPs per token and the backward's share of them: the dense model's (6N + attention, two thirds in
    the backward), or with recipe.lora the frozen base's 4N and the adapters' 6 (dstrain.plan.adapter_costs)."""
    if recipe.lora is not None:
        from dstrain.plan.adapter_costs import lora_flops_per_token

        return lora_flops_per_token(recipe)
    return flops_per_token(recipe.model, recipe.data.seq_len), 2 / 3


def zero3_fetches(recipe: Recipe, strategy: Strategy) -> int:
    """ZeRO-3 module fetches per step on one rank: each block's projections (and its experts'), the embedding and
    the head, once a micro-batch when the model stays gathered between forward and backward, else twice."""
    from dstrain.adapters.config import LoraConfig, target_names
    from dstrain.plan.traffic import keeps_gathered

    m = recipe.model
    projections = len(target_names(LoraConfig(), m)) if m.mla is None else 7
    experts = m.moe.num_experts // strategy.ep_size * 3 if m.moe is not None else 0
    modules = (m.n_layer - m.n_moe_layers) * projections + m.n_moe_layers * (4 + experts) + 2
    modules = -(-modules // strategy.pp_stages)
    zero = strategy.deepspeed_config.get("zero_optimization", {})
    per_micro = 1 if keeps_gathered(zero, layout_counts(recipe, strategy).per_rank) else 2
    return strategy.grad_accum * per_micro * modules


def engine_kind(strategy: Strategy) -> str:
    """Which calibrated engine cost applies: the pipeline engine's (1F1B and DualPipeV alike: the same instruction
    loop), else the ZeRO stage's (TP and SP take their stage's: not calibrated apart)."""
    return "pipeline" if strategy.pp_stages > 1 else f"zero{strategy.zero_stage}"


def layout_counts(recipe: Recipe, strategy: Strategy) -> ParamCounts:
    """The parameter counts of one rank under ``strategy``, as the memory model counts them."""
    zero = strategy.deepspeed_config.get("zero_optimization", {})
    threshold = zero.get("stage3_param_persistence_threshold", 100_000) if strategy.zero_stage == 3 else 0
    method = str(strategy.deepspeed_config.get("pipeline", {}).get("partition_method", "parameters")).lower()
    return count_params(
        recipe.model, strategy.tp_size, strategy.pp_stages, threshold, method, strategy.ep_size, strategy.pipe_schedule
    )


def expert_share(recipe: Recipe, strategy: Strategy, counts: ParamCounts) -> int:
    """Expert parameters a rank holds (reduced over the expert-data-parallel group, not the data-parallel one)."""
    moe = recipe.model.moe
    if moe is None:
        return 0
    from dstrain.model.counts import mlp_params

    per_layer = mlp_params(recipe.model, recipe.model.expert_dim) * moe.num_experts // strategy.ep_size
    return per_layer * recipe.model.n_moe_layers


def traffic_table(recipe: Recipe, strategy: Strategy, counts: ParamCounts) -> list[Traffic]:
    return step_traffic(recipe, strategy, counts, expert_share(recipe, strategy, counts))
