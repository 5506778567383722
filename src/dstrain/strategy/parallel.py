"""The ds_config sections that choose the parallel layout (pipeline, AutoTP, Ulysses SP, expert parallelism),
checked against the model before anything runs: the refusals resolve.py runs for dstrain.train and
dstrain plan alike. How the parameters then fall onto ranks is param_counts.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dstrain.config import Recipe
from dstrain.errors import InputError


@dataclass(frozen=True)
class Shape:
    """What resolution has read of a ds_config when the layout parts' checks run (dstrain.strategy.layouts)."""

    world_size: int
    zero_stage: int
    tp_size: int  # tensor_parallel.autotp_size
    pp_stages: int  # pipeline.stages
    sp_size: int  # sequence_parallel_size
    ep_size: int  # expert_parallel.autoep_size
    dp_size: int  # world // (tp x pp x sp): the world's divisibility is checked after the parts' checks
    micro_batch: int | None = None  # None until the batch is split
    grad_accum: int | None = None


def read_sizes(config: dict) -> tuple[int, int, int, int]:
    """(tensor-parallel, pipeline stages, sequence-parallel, expert-parallel) as the ds_config sets them, each a
    positive integer; what they may be combined with is each layout part's check."""
    tp_size = int(config.get("tensor_parallel", {}).get("autotp_size", 1))
    pp_stages = int(config.get("pipeline", {}).get("stages", 1))
    sp_size = config.get("sequence_parallel_size", 1)
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise InputError(f"sequence_parallel_size={sp_size!r}; use a positive integer (1 = off)")
    return tp_size, pp_stages, sp_size, _expert_parallel_size(config.get("expert_parallel"))


def check_data_parallel(config: dict, recipe: Recipe, shape: Shape) -> None:
    """The world splits into data-parallel replicas, over which ZeRO partitions: world / (tp x pp x sp)."""
    model_parallel = shape.tp_size * shape.pp_stages * shape.sp_size
    if shape.world_size % model_parallel:
        raise InputError(
            f"world size {shape.world_size} is not divisible by tensor-parallel {shape.tp_size} x pipeline "
            f"{shape.pp_stages} x sequence-parallel {shape.sp_size}; launch a multiple of {model_parallel} ranks"
        )


def _expert_parallel_size(section: dict | None) -> int:
    size = 1 if section is None or not section.get("enabled", False) else section.get("autoep_size", 1)
    extra = sorted(set(section or {}) - {"enabled", "autoep_size"})
    if extra:
        raise InputError(
            f'expert_parallel.{extra[0]} is an AutoEP option dstrain does not use; keep only "enabled" '
            f'and "autoep_size"'
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InputError(f"expert_parallel.autoep_size={size!r}; use a positive integer")
    return size


def check_expert_parallel(config: dict, recipe: Recipe, shape: Shape) -> None:
    """The expert-parallel size, the ds_config's "expert_parallel.autoep_size", checked against the recipe.

    DeepSpeed 0.19.8's classic MoE layer (the one dstrain uses, see dstrain/model/moe.py) takes its ep_size as a
    constructor argument and has no ds_config key; "expert_parallel" is the section DeepSpeed documents for expert
    parallelism (AutoEP), so dstrain reads the size there. The resolved ds_config keeps it (the run's record);
    resolution leaves it out of Strategy.deepspeed_config (strategy.resolved.OWN_SECTIONS): AutoEP finds no layer.
    """
    size, moe = shape.ep_size, recipe.model.moe
    if moe is not None:
        _check_moe_combinations(shape)
    if size == 1:
        return
    if moe is None:
        raise InputError("expert_parallel needs model.moe in the recipe; remove expert_parallel")
    if moe.num_experts % size:
        raise InputError(
            f"expert_parallel.autoep_size={size} does not divide model.moe.num_experts={moe.num_experts} "
            f"of the recipe; pick a divisor of num_experts"
        )
    if shape.dp_size % size:
        raise InputError(
            f"expert_parallel.autoep_size={size} does not divide the data-parallel size {shape.dp_size}; "
            f"launch a multiple of {size} ranks"
        )


def _check_moe_combinations(shape: Shape) -> None:
    """What a model.moe recipe cannot be combined with, each refused with its reason."""
    refusals = [
        # deepspeed/runtime/engine.py: "Native DeepSpeed MoE is not supported with ZeRO Stage 3" (canary:
        # tests/test_moe_router.py::test_deepspeed_classic_moe_refuses_zero3). Not needed to place the shipped MoE
        # recipes: ZeRO-2 with expert parallelism and optimizer offload fits Qwen3-30B-A3B on one node (docs/moe.md).
        (
            shape.zero_stage == 3,
            "ZeRO-3 cannot train the recipe's model.moe (DeepSpeed 0.19.8 supports its MoE layer with ZeRO stage "
            "0-2 only: https://github.com/deepspeedai/DeepSpeed/issues/2870); use ds_configs/ep2_zero2_bf16.json, "
            "or offload the optimizer (zero_optimization.offload_optimizer) to fit a larger model",
        ),
        # DeepSpeed's PipelineModule takes MoE layers since https://github.com/deepspeedai/DeepSpeed/pull/5338: the
        # limit is dstrain's (model/pipe.py builds dense stages, and steps.py adds no router losses on a pipeline).
        (
            shape.pp_stages > 1,
            "model.moe with pipeline.stages > 1 is not supported (dstrain's pipeline stages carry no DeepSpeed MoE "
            "layer); use ds_configs/ep2_zero1.json",
        ),
        (
            shape.tp_size > 1,
            "model.moe with tensor_parallel is not supported (untested in dstrain); use ds_configs/ep2_zero1.json",
        ),
        (
            shape.sp_size > 1,
            "model.moe with sequence_parallel_size > 1 is not supported (the experts' all-to-all and Ulysses' are "
            "not combined in dstrain); remove sequence_parallel_size or model.moe",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise InputError(message)


TP_LAYOUT = {
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.down_proj": "row",
}


PIPE_SCHEDULES = ("1f1b", "dualpipev")  # ds_config "pipeline.schedule": PipelineModule, or DualPipeVModule


def check_pipeline(config: dict, recipe: Recipe, shape: Shape) -> None:
    """pipeline.*: the schedule, the stages against the model's blocks and the ZeRO stage, the partition method."""
    if shape.pp_stages == 1:
        return
    if shape.zero_stage > 1:
        raise InputError(
            f"pipeline parallelism works with ZeRO stage 0 or 1, not {shape.zero_stage}; "
            f"set zero_optimization.stage to 1"
        )
    pipeline, n_layer = config["pipeline"], recipe.model.n_layer
    schedule = pipeline.get("schedule", "1f1b")
    if schedule not in PIPE_SCHEDULES:
        raise InputError(f'pipeline.schedule={schedule!r}; use "1f1b" or "dualpipev"')
    stages = int(pipeline.get("stages", 1))
    if stages > n_layer:
        raise InputError(f"pipeline.stages={stages} exceeds the model's {n_layer} blocks in the recipe")
    if schedule == "dualpipev" and 2 * stages > n_layer:
        raise InputError(
            f"pipeline.schedule dualpipev cuts the model into 2 x pipeline.stages = {2 * stages} stages, "
            f"more than the {n_layer} blocks of the recipe; lower pipeline.stages or use schedule 1f1b"
        )
    method = str(pipeline.get("partition_method", "parameters"))
    if method not in ("parameters", "uniform") and not method.startswith("type:"):
        raise InputError(f'pipeline.partition_method={method!r}; use "parameters", "uniform" or "type:Block"')
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise InputError(f"pipeline.activation_checkpoint_interval={interval!r}; use 0 (off) or a positive integer")


def check_tensor_parallel(config: dict, recipe: Recipe, shape: Shape) -> None:
    """tensor_parallel.*: AutoTP against the model's attention and the other layouts."""
    if shape.tp_size == 1:
        return
    tp, size = config["tensor_parallel"], shape.tp_size
    if shape.pp_stages > 1:
        # DeepSpeed 0.19.8: AutoTP swaps the pipeline engine's grid for its own data x tensor mesh, which ignores the
        # stages, so the engine broadcasts weights between stages and dies (tests/test_parallel.py pins the cause).
        raise InputError(
            "tensor_parallel with pipeline.stages > 1 is not supported by DeepSpeed's pipeline engine; "
            "use ds_configs/tp2_zero1.json or ds_configs/pp2_zero1.json"
        )
    model = recipe.model
    if model.qk_norm == "projection":
        raise InputError(
            "tensor_parallel with model.qk_norm projection (OLMo 2) is not supported: the norm spans every "
            "head, AutoTP splits the heads; use a ZeRO or sequence-parallel config"
        )
    if model.attention_sinks:
        raise InputError(
            "tensor_parallel with model.attention_sinks is not supported: AutoTP splits the heads and "
            "leaves each head's sink whole; use a ZeRO or expert-parallel config"
        )
    if model.mla is not None:
        # The latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms must stay whole on every rank while
        # q_b_proj/q_proj and kv_b_proj split by heads: AutoTP's llama preset names none of them.
        raise InputError(
            "tensor_parallel with model.mla is not supported: AutoTP does not know which of the latent "
            "attention's projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) split; use a ZeRO, "
            "sequence-parallel or expert-parallel config"
        )
    if model.kv_heads % size:
        raise InputError(
            f"tensor_parallel.autotp_size={size} does not divide the {model.kv_heads} key/value heads of "
            f"the recipe (model.n_kv_head / model.n_head); pick an autotp_size that divides them"
        )
    specs = (tp.get("partition_config") or {}).get("layer_specs") or []
    for module, kind in TP_LAYOUT.items():
        name = f"blocks.0.{module}.weight"
        # AutoTP takes the first spec whose pattern re.match-es the weight's name (model_types never match: our
        # config has no HF model_type).
        found = next(
            (
                str(spec.get("partition_type", "column")).lower()
                for spec in specs
                if not spec.get("model_types") and any(re.match(p, name) for p in spec.get("patterns", []))
            ),
            None,
        )
        if found != kind:
            raise InputError(
                f"tensor_parallel.partition_config must split {module} {kind}-wise (it says {found}); "
                f"use the layer_specs of ds_configs/tp2_zero1.json"
            )


def check_sequence_parallel(config: dict, recipe: Recipe, shape: Shape) -> None:
    """The ds_config's ``sequence_parallel_size`` (Ulysses), checked against the model and the other layouts."""
    size = shape.sp_size
    if size == 1:
        return
    if shape.pp_stages > 1:
        # DeepSpeed's pipeline engine takes its own grid as mpu; the SP groups are another mpu (one per engine).
        raise InputError(
            "sequence_parallel_size with pipeline.stages > 1 is not supported by DeepSpeed's pipeline "
            "engine; use ds_configs/sp2_zero1.json or ds_configs/pp2_zero1.json"
        )
    if shape.tp_size > 1:
        # AutoTP installs its own data x tensor mesh as the engine's mpu, which has no sequence dimension.
        raise InputError(
            "sequence_parallel_size with tensor_parallel is not supported by DeepSpeed 0.19's AutoTP; "
            "use ds_configs/sp2_zero1.json or ds_configs/tp2_zero1.json"
        )
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True) is False:
        # dstrain.train.engine.sequence.backward_factor corrects the one ZeRO-3 path that averages over the SP group.
        raise InputError(
            "sequence_parallel_size with ZeRO-3 needs zero_optimization.reduce_scatter on (its default); "
            "remove reduce_scatter: false"
        )
    model = recipe.model
    if model.attention_sinks:
        raise InputError(
            "sequence_parallel_size with model.attention_sinks is not supported: after the all-to-all a "
            "rank attends with a slice of the heads, whose sinks the core is not given; use a ZeRO config"
        )
    if model.rope_scaling is not None and model.rope_scaling.type == "longrope":  # issue 50
        raise InputError(
            "sequence_parallel_size with model.rope_scaling longrope is not supported: it picks its "
            "factors by the batch's largest position, which each rank sees only in its slice; use a ZeRO config"
        )
    if model.n_head % size:  # beyond the key/value heads, each rank repeats them (dstrain.train.engine.sequence)
        fits = [n for n in range(2, model.n_head + 1) if model.n_head % n == 0]
        raise InputError(
            f"sequence_parallel_size={size} does not divide the {model.n_head} query heads of "
            f"the recipe (model.n_head); each rank attends with whole heads: pick one of {fits}"
        )
    if recipe.data.seq_len % size:
        raise InputError(
            f"sequence_parallel_size={size} does not divide data.seq_len={recipe.data.seq_len} of "
            f"the recipe; each rank holds an equal slice: pick a seq_len that is a multiple of {size}"
        )


def kv_replicas(n_head: int, kv_heads: int, sp_size: int) -> int:
    """How many copies of each key/value head SP exchanges: 1 where SP divides the key/value heads, else the fewest
    r dividing the group (n_head / kv_heads query heads per key/value head) with kv_heads·r a multiple of SP, so that
    rank i's n_head/sp query heads find their key/value heads among its kv_heads·r/sp (r = the group size, as many
    as the query heads, always does: SP divides the query heads)."""
    group = n_head // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and kv_heads * r % sp_size == 0)


def check_pipeline_accumulation(config: dict, recipe: Recipe, shape: Shape) -> None:
    """DeepSpeed's DualPipeVEngine asserts gradient_accumulation_steps >= 2 x stages inside deepspeed.initialize."""
    pp_stages, grad_accum = shape.pp_stages, shape.grad_accum if shape.grad_accum is not None else 0
    if pp_stages > 1 and config["pipeline"].get("schedule") == "dualpipev" and grad_accum < 2 * pp_stages:
        micro = config["train_micro_batch_size_per_gpu"]
        samples = micro * grad_accum  # per data-parallel replica and step
        fits = [m for m in range(samples // (2 * pp_stages), 0, -1) if samples % m == 0]
        fix = f"set train_micro_batch_size_per_gpu to {fits[0]}" if fits else "raise the recipe's train.global_batch"
        raise InputError(
            f"pipeline.schedule dualpipev needs at least 2 x pipeline.stages = {2 * pp_stages} "
            f"micro-batches per step, train_micro_batch_size_per_gpu={micro} gives {grad_accum}; {fix} or use "
            f"schedule 1f1b"
        )
