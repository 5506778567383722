"""The layouts ``dstrain plan`` weighs: ds_configs in DeepSpeed's schema, resolved by the same ``resolve`` that
dstrain.train runs (its refusals are the planner's), sized by the memory model, timed by the time model.

Enumerated: ZeRO 0-3; CPU offload of the optimizer (stage 1-3) and of the parameters (stage 3); tensor-parallel,
pipeline (1F1B and DualPipeV schedules), sequence-parallel and expert-parallel sizes (powers of two; TP within a
node, a planner policy: its per-block collectives across nodes never win; SP up to the query heads, across
nodes); micro-batches (powers of two); activation checkpointing, on the device or held on the host
(``cpu_checkpointing``); the chunked loss (``tiling.loss``: the fewest chunks of at most 1 GiB where the whole
loss's logits exceed that, dstrain.strategy.tiling.auto_loss_tiles, against 1) and the tiled MLP (``tiling.mlp`` 4,
without a pipeline). The memory model counts what each lever frees (on the device, and on each node's host:
``Device.host_memory_gib``, ``plan --host-gib``), the time model what each recomputes and moves (the tiled MLP;
the chunked loss recomputes nothing); for each layout the largest micro-batch that fits is kept with the
smaller ones.
Not enumerated: NVMe offload (it needs a path on the cluster's nodes), fp32 and fp16 where bf16 runs (bf16 is as
exact here: dstrain sums its gradients in fp32).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.plan.memory import estimate
from dstrain.plan.memory_parts import GIB, Estimate
from dstrain.plan.time_model import Cluster, Prediction, layout_counts, predict, train_flops_per_token
from dstrain.precision import Precision
from dstrain.strategy.ds_schema import validate_ds_config
from dstrain.strategy.resolve import AUTO, Strategy, resolve_config
from dstrain.strategy.tiling import LOSS_TILE_BYTES, auto_loss_tiles

# AutoTP's split of dstrain's projections (the layer_specs of ds_configs/tp2_zero1.json).
TP_SPECS = [
    {"patterns": [".*\\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\\.weight$"], "partition_type": "column"},
    {"patterns": [".*\\.(o_proj|down_proj)\\.weight$"], "partition_type": "row"},
]
CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False}


@dataclass(frozen=True)
class Layout:
    zero: int
    micro: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    offload: str = "none"  # "none", "optimizer" (to the CPU) or "optimizer+params"
    checkpointing: bool = False
    schedule: str = "1f1b"  # the pipeline's ("pipeline.schedule"): "1f1b" or "dualpipev"
    chunked_loss: bool = False  # "tiling.loss": "auto" (chunked where the logits are large), else 1 (whole)
    mlp_tiles: int = 1  # "tiling.mlp"
    host_checkpoints: bool = False  # "activation_checkpointing.cpu_checkpointing": checkpoints held on the host

    def ds_config(self, precision: Precision, torch_adam: bool) -> dict:
        """This layout as a ds_config: the recipe's fields "auto", the strategy's set."""
        zero: dict = {"stage": self.zero, "reduce_bucket_size": 50_000_000}
        if self.zero >= 2:
            zero.update(overlap_comm=True, contiguous_gradients=True)
        if self.zero == 3:
            zero.update(
                stage3_prefetch_bucket_size=50_000_000,
                stage3_param_persistence_threshold=100_000,
                stage3_gather_16bit_weights_on_model_save=True,
            )
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload == "optimizer+params":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        params: dict = {key: AUTO for key in ("lr", "betas", "eps", "weight_decay")}
        if torch_adam and self.offload == "none":
            params["torch_adam"] = True
        config: dict = {
            "train_batch_size": AUTO,
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": AUTO,
            "gradient_clipping": AUTO,
            "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": zero,
        }
        if precision != "fp32":
            config[precision] = {"enabled": True}
            config["data_types"] = {"grad_accum_dtype": "fp32"}
            config["communication_data_type"] = "fp32"
        if self.tp > 1:
            config["tensor_parallel"] = {
                "autotp_size": self.tp,
                "partition_config": {"use_default_specs": False, "layer_specs": copy.deepcopy(TP_SPECS)},
            }
        if self.pp > 1:
            config["pipeline"] = {
                "stages": self.pp,
                "partition_method": "parameters",
                "activation_checkpoint_interval": int(self.checkpointing),
            }
            if self.schedule != "1f1b":
                config["pipeline"]["schedule"] = self.schedule
        if self.checkpointing and (self.pp == 1 or self.host_checkpoints):
            config["activation_checkpointing"] = dict(CHECKPOINTING, cpu_checkpointing=self.host_checkpoints)
        if self.sp > 1:
            config["sequence_parallel_size"] = self.sp
        config["tiling"] = {"loss": AUTO if self.chunked_loss else 1}
        if self.mlp_tiles > 1:
            config["tiling"]["mlp"] = self.mlp_tiles
        if self.ep > 1:
            config["expert_parallel"] = {"enabled": True, "autoep_size": self.ep}
        return config

    def describe(self) -> str:
        sizes = (("TP", self.tp), ("PP", self.pp), ("SP", self.sp), ("EP", self.ep))
        parts = [f"ZeRO-{self.zero}"] + [f"{name}{size}" for name, size in sizes if size > 1]
        if self.schedule == "dualpipev":
            parts.append("DualPipeV")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.checkpointing:
            parts.append("act-ckpt on host" if self.host_checkpoints else "act-ckpt")
        if self.chunked_loss:
            parts.append("chunked-loss")
        if self.mlp_tiles > 1:
            parts.append(f"mlp-tiles{self.mlp_tiles}")
        return " ".join(parts)


@dataclass
class Planned:
    layout: Layout
    ds_config: dict  # as written: "auto" where the recipe owns the value
    strategy: Strategy
    estimate: Estimate
    prediction: Prediction
    tokens_per_s: float
    mfu: float | None


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidate_layouts(recipe: Recipe, cluster: Cluster) -> list[list[Layout]]:
    """Every layout shape, each a list of its micro-batch sizes in increasing order (memory grows with them)."""
    world, g = cluster.nodes * cluster.gpus_per_node, cluster.gpus_per_node
    experts = recipe.model.moe.num_experts if recipe.model.moe else 1
    micros = powers_of_two(min(recipe.train.global_batch, 64))
    shapes, moe = [], recipe.model.moe is not None
    # SP up to the query heads, across nodes too: long sequences need more ranks than a node has (beyond the key/value
    # heads each rank repeats them: dstrain.train.engine.sequence)
    sizes_sp = [sp for sp in powers_of_two(min(world, recipe.model.n_head)) if recipe.model.n_head % sp == 0]
    for tp in powers_of_two(g):
        for sp in sizes_sp:
            for pp in powers_of_two(min(world, recipe.model.n_layer)):
                for ep in powers_of_two(experts):
                    if tp * sp * pp * ep > world:
                        continue
                    for zero in range(4):
                        for offload in ("none", "optimizer", "optimizer+params")[: 1 + (zero > 0) + (zero == 3)]:
                            for ckpt, host in ((False, False), (True, False), (True, True)):
                                for sched in ("1f1b", "dualpipev") if pp > 1 else ("1f1b",):
                                    shape = (zero, tp, pp, sp, ep, offload, ckpt, sched, host)
                                    shapes += [
                                        _micro_batches(shape, micros, *levers) for levers in tiling_levers(pp, moe)
                                    ]
    return shapes


def tiling_levers(pp: int, moe: bool) -> list[tuple[bool, int]]:
    """(chunked loss, MLP tiles) to weigh: each alone and both; the MLP is not tiled in a pipeline or a mixture of
    experts (both refused: dstrain.strategy.tiling)."""
    return [(False, 1), (True, 1)] + ([(False, 4), (True, 4)] if pp == 1 and not moe else [])


def _micro_batches(shape: tuple, micros: list[int], chunked: bool, mlp_tiles: int) -> list[Layout]:
    zero, tp, pp, sp, ep, offload, ckpt, sched, host = shape
    return [Layout(zero, m, tp, pp, sp, ep, offload, ckpt, sched, chunked, mlp_tiles, host) for m in micros]


def plan(
    recipe: Recipe, cluster: Cluster, precision: Precision, top: int, torch_adam: bool = False
) -> tuple[list[Planned], int]:
    """The ``top`` fastest layouts that dstrain accepts and that fit, fastest first, and how many fit in all.
    DeepSpeed's own parser (resolve's last check, 40 ms a config) runs on those kept only."""
    world = cluster.nodes * cluster.gpus_per_node
    device = cluster.device
    found = []
    for shape in candidate_layouts(recipe, cluster):
        for layout in shape:
            config = layout.ds_config(precision, torch_adam)
            if layout.chunked_loss:  # written as a count: chunked wherever the logits exceed one chunk
                seq, vocab = recipe.data.seq_len // layout.sp, recipe.model.vocab_size
                chunks = auto_loss_tiles(layout.micro, seq, vocab, above=LOSS_TILE_BYTES)
                if chunks == 1:
                    continue  # the whole loss is one chunk: the unchunked layout already weighs it
                config["tiling"]["loss"] = chunks
            try:
                name = f"plan:{layout.describe()}"
                strategy = resolve_config(recipe, config, name, world, check_device=False, validate=False)
                est = estimate(recipe, strategy, cluster.nodes, cluster.gpus_per_node, device.memory_gib)
            except DstrainError:  # refused by dstrain.train's own checks
                continue
            if layout.chunked_loss and strategy.loss_tiles == 1:
                continue  # "auto" keeps this micro-batch's loss whole: the unchunked layout already weighs it
            if not fits(est, cluster):
                break  # a larger micro-batch needs more memory still
            found.append(_timed(recipe, layout, config, strategy, est, cluster, precision))
    # Equal predictions (compute-bound, communication hidden): fewer micro-batches first, since each costs engine
    # time the model does not see (measured on 2 CPU ranks: ~1 s per ZeRO-3 micro-batch, BENCHMARKS.md); then the
    # lower peak (the chunked loss, which costs no time: dstrain.model.chunked_loss, over the whole one).
    found.sort(key=lambda p: (float(f"{p.prediction.step_s:.6g}"), p.strategy.grad_accum, p.estimate.peak()))
    kept = []
    for planned in found:
        try:
            validate_ds_config(planned.strategy.resolved_ds_config)
        except DstrainError:
            continue
        kept.append(planned)
        if len(kept) == top:
            break
    return kept, len(found)


def fits(est: Estimate, cluster: Cluster) -> bool:
    """The device's memory, and the host's of each node (offloaded state, checkpoints held on the host)."""
    return est.fits and est.peak("cpu") * cluster.gpus_per_node <= cluster.device.host_memory_gib * GIB


def longest_fitting_sequence(recipe: Recipe, cluster: Cluster, precision: Precision) -> int | None:
    """The longest data.seq_len, halving the recipe's, at which some layout fits ``cluster``; None below 1024."""
    seq = recipe.data.seq_len // 2
    while seq >= 1024:
        shorter = replace(recipe, data=replace(recipe.data, seq_len=seq))
        if fits_somewhere(shorter, cluster, precision):
            return seq
        seq //= 2
    return None


def fits_somewhere(recipe: Recipe, cluster: Cluster, precision: Precision) -> bool:
    """Whether any layout dstrain accepts fits ``cluster`` (the memory model only, its smallest micro-batch)."""
    world = cluster.nodes * cluster.gpus_per_node
    for shape in candidate_layouts(recipe, cluster):
        for layout in shape:
            try:
                config = layout.ds_config(precision, False)
                strategy = resolve_config(recipe, config, "plan", world, check_device=False, validate=False)
                est = estimate(recipe, strategy, cluster.nodes, cluster.gpus_per_node, cluster.device.memory_gib)
            except DstrainError:
                continue
            if fits(est, cluster):
                return True
            break  # the smallest micro-batch this layout accepts does not fit: no larger one will
    return False


def smallest_fitting_nodes(recipe: Recipe, cluster: Cluster, precision: Precision, most: int = 1024) -> int | None:
    """The fewest nodes (of ``cluster``'s kind, more than it has) on which some layout fits, or None up to ``most``:
    doubling, then bisecting between the last count that does not fit and the first that does."""

    def fits(nodes: int) -> bool:
        return fits_somewhere(recipe, replace(cluster, nodes=nodes), precision)

    low, high = cluster.nodes, cluster.nodes * 2
    while not fits(high):
        low, high = high, high * 2
        if high > most:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _timed(
    recipe: Recipe,
    layout: Layout,
    config: dict,
    strategy: Strategy,
    est: Estimate,
    cluster: Cluster,
    precision: Precision,
) -> Planned:
    pred = predict(recipe, strategy, layout_counts(recipe, strategy), cluster)
    tokens_per_s = recipe.train.global_batch * recipe.data.seq_len / pred.step_s
    world = cluster.nodes * cluster.gpus_per_node
    peak = cluster.device.peak_tflops.get(precision)
    # the FLOPs the step runs: with adapters the frozen matrices' weight gradients are not among them
    mfu = train_flops_per_token(recipe)[0] * tokens_per_s / (world * peak * 1e12) if peak else None
    return Planned(layout, config, strategy, est, pred, tokens_per_s, mfu)
