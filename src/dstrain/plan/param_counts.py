"""Parameters per rank under a parallel layout, counted on a meta-device model (no memory: a 70B recipe in
seconds); and the activations MoE blocks add. Used by the memory model (dstrain estimate, dstrain plan)."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import math
from dataclasses import asdict, dataclass, replace

from dstrain.model.config import GPTConfig
from dstrain.model.counts import num_params
from dstrain.precision import Precision

EXPERTS = ".deepspeed_experts."  # in the names of expert parameters (DeepSpeed's MoE layer)
# Tensor-parallel (AutoTP) shards these linear layers; embeddings, norms and the head are replicated.
TP_SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


MOE_FORMULA = "n_moe·k·T·(4·h + 4·f_e)·a + n_moe·T·4·s·f_e·a − n_moe·T·4·f·a"  # n_moe: 1 under checkpointing


def moe_activation_bytes(model: GPTConfig, tokens: int, precision: Precision, checkpointing: bool = False) -> int:
    """What a rank's MoE layers save for backward beyond the dense model's MLPs (counted in memory.activation_bytes):
    each of the k·T routed copies of a token passes through DeepSpeed's dispatch buffer and the expert's output,
    both before and after their all-to-all (4·h), and through an expert of width f_e (gate, up, silu(gate), product:
    4·f_e, llama), and every token through DeepSeekMoE's s shared experts (one MLP 4·s·f_e wide); the dense MLP's
    4·f per token is not there. Balanced routing; dropless dispatch pads every
    expert's buffer to the busiest expert's count, which can add up to the whole buffer again. With activation
    checkpointing only the block being recomputed holds them (its input is counted with the dense model's)."""
    assert model.moe is not None
    a = 4 if precision == "fp32" else 2
    routed = tokens * model.moe.top_k
    shared = tokens * 4 * model.moe.n_shared_experts * model.expert_dim * a
    extra = routed * (4 * model.d_model + 4 * model.expert_dim) * a + shared - tokens * 4 * model.ff_dim * a
    return max(0, (1 if checkpointing else model.n_moe_layers) * extra)


@dataclass(frozen=True)
class ParamCounts:
    total: int  # unique parameters of GPT(config), counted on the meta device
    per_rank: int  # held by one model-parallel rank (worst pipeline stage, TP-sharded linears)
    persistent: int  # ZeRO-3: parameters whole on every rank (numel <= persistence threshold)
    largest_param: int  # elements of the largest tensor (offload staging buffers)
    largest_layer: int  # most parameters owned directly by one module (DeepSpeed's "largest layer")


def count_params(
    model: GPTConfig,
    tp: int = 1,
    pp: int = 1,
    persistence_threshold: int = 0,
    partition_method: str = "parameters",
    ep: int = 1,
    schedule: str = "1f1b",
) -> ParamCounts:
    """Count on a meta-device model: no memory, a 70B recipe in seconds; checked against num_params.
    Expert parallelism `ep` divides each MoE layer's experts over `ep` ranks; `schedule` is the pipeline's."""
    return _count_params(json.dumps(asdict(model)), tp, pp, persistence_threshold, partition_method, ep, schedule)


@functools.lru_cache(maxsize=256)  # dstrain plan counts each layout shape once, not once per micro-batch
def _count_params(
    config_json: str, tp: int, pp: int, persistence_threshold: int, partition_method: str, ep: int, schedule: str
) -> ParamCounts:
    model = GPTConfig.from_dict(json.loads(config_json))
    named = [(name, math.prod(shape)) for name, shape in _meta_shapes(config_json)]
    total = sum(numel for _, numel in named)
    if total != num_params(model):
        raise AssertionError(f"meta-device count {total} != num_params {num_params(model)} for {model}")
    sharded = sum(numel for name, numel in named if any(f".{s}." in name for s in TP_SHARDED))
    experts = sum(numel for name, numel in named if EXPERTS in name)
    per_tp = total - sharded + math.ceil(sharded / tp) - experts + experts // ep
    layers: collections.Counter[str] = collections.Counter()
    for name, numel in named:
        layers[name.rsplit(".", 1)[0]] += numel
    return ParamCounts(
        total=total,
        per_rank=_worst_stage(named, model, tp, pp, partition_method, schedule) if pp > 1 else per_tp,
        persistent=sum(numel for _, numel in named if numel <= persistence_threshold),
        largest_param=max(numel for _, numel in named),
        largest_layer=max(layers.values()),
    )


def _worst_stage(named, model: GPTConfig, tp: int, pp: int, method: str, schedule: str) -> int:
    """Parameters of the largest pipeline rank, cut as DeepSpeed's PipelineModule cuts dstrain.model.pipe's layers
    (embedding, blocks, final norm, head): whole layers per stage, and a tied head is a second copy of the
    embedding on the last stage, which DeepSpeed also counts when it balances the stages. DualPipeVModule cuts
    2 x pp stages, rank r holding stage r and 2 x pp - 1 - r; the tied head is the embedding itself there (rank 0)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    from dstrain.model.pipe import layer_prefixes

    def layer_count(prefix: str, sharded_by: int = 1) -> int:
        return sum(
            math.ceil(n / sharded_by) if any(f".{s}." in name for s in TP_SHARDED) else n
            for name, n in named
            if name.startswith(prefix)
        )

    prefixes = [p[0] if p else "embed." for p in layer_prefixes(model)]  # None: the tied head, the embedding
    whole = [layer_count(p) for p in prefixes]
    parts = 2 * pp if schedule == "dualpipev" else pp
    if method == "parameters":
        bounds = partition_balanced(whole, parts)
    elif method == "uniform":
        bounds = partition_uniform(len(whole), parts)
    else:  # "type:Block": balance the blocks
        bounds = partition_balanced([int(p.startswith("blocks.")) for p in prefixes], parts)
    held = [layer_count(p, tp) for p in prefixes]
    stage = [sum(held[bounds[i] : bounds[i + 1]]) for i in range(parts)]
    if schedule != "dualpipev":
        return max(stage)
    tied = held[-1] if layer_prefixes(model)[-1] is None else 0
    return max(stage[r] + stage[parts - 1 - r] - (tied if r == 0 else 0) for r in range(pp))


def meta_shapes(config: GPTConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of GPT(config)'s parameters, in order, built on the meta device (a tied matrix appears once)."""
    return _meta_shapes(json.dumps(asdict(config)))


_LAST_OF_THREE = f"{EXPERTS}2."  # in the names of the last expert's parameters, built with 3


@functools.lru_cache(maxsize=8)
def _meta_shapes(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = GPTConfig.from_dict(json.loads(config_json))
    if config.moe is None or config.moe.num_experts <= 3:
        return _built_shapes(config)
    # DeepSpeed's MoE layer deep-copies its template once per expert: Qwen3-30B-A3B's 6,144 experts took 5 s of the
    # planner's 11 s on the meta device. Every expert has the same parameters, and the rest (the router) grows
    # linearly with their number: build 2 and 3 experts, and extend to num_experts.
    two, three = (_built_shapes(replace(config, moe=replace(config.moe, num_experts=k, top_k=1))) for k in (2, 3))
    grown = config.moe.num_experts - 3
    earlier = dict(two)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for is_last_expert, run in itertools.groupby(three, key=lambda item: _LAST_OF_THREE in item[0]):
        if is_last_expert:  # expert 2 of one layer, in order: stands for experts 2 .. num_experts - 1
            names = list(run)
            shapes += [(n.replace(_LAST_OF_THREE, f"{EXPERTS}{e}."), s) for e in range(2, 3 + grown) for n, s in names]
        else:
            shapes += [(n, tuple(d + grown * (d - d2) for d, d2 in zip(s, earlier[n]))) for n, s in run]
    return tuple(shapes)


def _built_shapes(config: GPTConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch

    from dstrain.model.gpt import GPT

    with torch.device("meta"):
        gpt = GPT(config)
    return tuple((name, tuple(p.shape)) for name, p in gpt.named_parameters())


# What AutoTP must do to each projection of a block (gpt2 has no gate_proj; nothing else is sharded).
