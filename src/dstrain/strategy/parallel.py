"""The ds_config sections that choose the parallel layout (pipeline, AutoTP, Ulysses SP, expert parallelism),
checked against the model before anything runs: the refusals resolve.py runs for dstrain.train and
dstrain plan alike. How the parameters then fall onto ranks is param_counts.py."""

from __future__ import annotations

import re

from dstrain.config import Recipe
from dstrain.errors import DstrainError


def _expert_parallel_size(section: dict | None, ds_file: str) -> int:
    size = 1 if section is None or not section.get("enabled", False) else section.get("autoep_size", 1)
    extra = sorted(set(section or {}) - {"enabled", "autoep_size"})
    if extra:
        raise DstrainError(
            f'{ds_file}: expert_parallel.{extra[0]} is an AutoEP option dstrain does not use; keep only "enabled" '
            f'and "autoep_size"'
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DstrainError(f"{ds_file}: expert_parallel.autoep_size={size!r}; use a positive integer")
    return size


def check_expert_parallel(
    config: dict,
    recipe: Recipe,
    recipe_file: str,
    ds_file: str,
    dp_size: int,
    pp_stages: int,
    tp_size: int,
    sp_size: int = 1,
) -> int:
    """The expert-parallel size: the ds_config's "expert_parallel.autoep_size", checked against the recipe.

    DeepSpeed 0.19.8's classic MoE layer (the one dstrain uses, see dstrain/model/moe.py) takes its ep_size as a
    constructor argument and has no ds_config key; "expert_parallel" is the section DeepSpeed documents for expert
    parallelism (AutoEP), so dstrain reads the size there. The resolved ds_config keeps it (the run's record);
    resolution leaves it out of Strategy.deepspeed_config (strategy.resolved.OWN_SECTIONS): AutoEP finds no layer.
    """
    size, moe = _expert_parallel_size(config.get("expert_parallel"), ds_file), recipe.model.moe
    if moe is not None:
        _check_moe_combinations(config, recipe_file, ds_file, pp_stages, tp_size, sp_size)
    if size == 1:
        return 1
    if moe is None:
        raise DstrainError(f"{ds_file}: expert_parallel needs model.moe in {recipe_file}; remove expert_parallel")
    if moe.num_experts % size:
        raise DstrainError(
            f"{ds_file}: expert_parallel.autoep_size={size} does not divide model.moe.num_experts={moe.num_experts} "
            f"of {recipe_file}; pick a divisor of num_experts"
        )
    if dp_size % size:
        raise DstrainError(
            f"{ds_file}: expert_parallel.autoep_size={size} does not divide the data-parallel size {dp_size}; "
            f"launch a multiple of {size} ranks"
        )
    return size


def _check_moe_combinations(
    config: dict, recipe_file: str, ds_file: str, pp_stages: int, tp_size: int, sp_size: int
) -> None:
    """What a model.moe recipe cannot be combined with, each refused with its reason."""
    refusals = [
        # deepspeed/runtime/engine.py: "Native DeepSpeed MoE is not supported with ZeRO Stage 3" (canary:
        # tests/test_moe_router.py::test_deepspeed_classic_moe_refuses_zero3). Not needed to place the shipped MoE
        # recipes: ZeRO-2 with expert parallelism and optimizer offload fits Qwen3-30B-A3B on one node (docs/moe.md).
        (
            config["zero_optimization"].get("stage", 0) == 3,
            f"ZeRO-3 cannot train {recipe_file}'s model.moe (DeepSpeed 0.19.8 supports its MoE layer with ZeRO stage "
            f"0-2 only: https://github.com/deepspeedai/DeepSpeed/issues/2870); use ds_configs/ep2_zero2_bf16.json, "
            f"or offload the optimizer (zero_optimization.offload_optimizer) to fit a larger model",
        ),
        # DeepSpeed's PipelineModule takes MoE layers since https://github.com/deepspeedai/DeepSpeed/pull/5338: the
        # limit is dstrain's (model/pipe.py builds dense stages, and steps.py adds no router losses on a pipeline).
        (
            pp_stages > 1,
            "model.moe with pipeline.stages > 1 is not supported (dstrain's pipeline stages carry no DeepSpeed MoE "
            "layer); use ds_configs/ep2_zero1.json",
        ),
        (
            tp_size > 1,
            "model.moe with tensor_parallel is not supported (untested in dstrain); use ds_configs/ep2_zero1.json",
        ),
        (
            sp_size > 1,
            "model.moe with sequence_parallel_size > 1 is not supported (the experts' all-to-all and Ulysses' are "
            "not combined in dstrain); remove sequence_parallel_size or model.moe",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise DstrainError(f"{ds_file}: {message}")


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


def check_pipeline(pipeline: dict, ds_file: str, n_layer: int, recipe_file: str) -> None:
    schedule = pipeline.get("schedule", "1f1b")
    if schedule not in PIPE_SCHEDULES:
        raise DstrainError(f'{ds_file}: pipeline.schedule={schedule!r}; use "1f1b" or "dualpipev"')
    stages = int(pipeline.get("stages", 1))
    if stages > n_layer:
        raise DstrainError(f"{ds_file}: pipeline.stages={stages} exceeds the model's {n_layer} blocks in {recipe_file}")
    if schedule == "dualpipev" and 2 * stages > n_layer:
        raise DstrainError(
            f"{ds_file}: pipeline.schedule dualpipev cuts the model into 2 x pipeline.stages = {2 * stages} stages, "
            f"more than the {n_layer} blocks of {recipe_file}; lower pipeline.stages or use schedule 1f1b"
        )
    method = str(pipeline.get("partition_method", "parameters"))
    if method not in ("parameters", "uniform") and not method.startswith("type:"):
        raise DstrainError(
            f'{ds_file}: pipeline.partition_method={method!r}; use "parameters", "uniform" or "type:Block"'
        )
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise DstrainError(
            f"{ds_file}: pipeline.activation_checkpoint_interval={interval!r}; use 0 (off) or a positive integer"
        )


def check_tensor_parallel(tp: dict, recipe: Recipe, recipe_file, ds_file: str, pp_stages: int) -> None:
    size = int(tp["autotp_size"])
    if pp_stages > 1:
        # DeepSpeed 0.19.8: AutoTP swaps the pipeline engine's grid for its own data x tensor mesh, which ignores the
        # stages, so the engine broadcasts weights between stages and dies (tests/test_parallel.py pins the cause).
        raise DstrainError(
            f"{ds_file}: tensor_parallel with pipeline.stages > 1 is not supported by DeepSpeed's pipeline engine; "
            f"use ds_configs/tp2_zero1.json or ds_configs/pp2_zero1.json"
        )
    model = recipe.model
    if model.qk_norm == "projection":
        raise DstrainError(
            f"{ds_file}: tensor_parallel with model.qk_norm projection (OLMo 2) is not supported: the norm spans every "
            f"head, AutoTP splits the heads; use a ZeRO or sequence-parallel config"
        )
    if model.attention_sinks:
        raise DstrainError(
            f"{ds_file}: tensor_parallel with model.attention_sinks is not supported: AutoTP splits the heads and "
            f"leaves each head's sink whole; use a ZeRO or expert-parallel config"
        )
    if model.mla is not None:
        # The latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms must stay whole on every rank while
        # q_b_proj/q_proj and kv_b_proj split by heads: AutoTP's llama preset names none of them.
        raise DstrainError(
            f"{ds_file}: tensor_parallel with model.mla is not supported: AutoTP does not know which of the latent "
            f"attention's projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) split; use a ZeRO, "
            f"sequence-parallel or expert-parallel config"
        )
    if model.kv_heads % size:
        raise DstrainError(
            f"{ds_file}: tensor_parallel.autotp_size={size} does not divide the {model.kv_heads} key/value heads of "
            f"{recipe_file} (model.n_kv_head / model.n_head); pick an autotp_size that divides them"
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
            raise DstrainError(
                f"{ds_file}: tensor_parallel.partition_config must split {module} {kind}-wise (it says {found}); "
                f"use the layer_specs of ds_configs/tp2_zero1.json"
            )


def check_sequence_parallel(
    config: dict, recipe: Recipe, recipe_file, ds_file: str, tp_size: int, pp_stages: int
) -> int:
    """The ds_config's ``sequence_parallel_size`` (Ulysses), checked against the model and the other layouts."""
    size = config.get("sequence_parallel_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DstrainError(f"{ds_file}: sequence_parallel_size={size!r}; use a positive integer (1 = off)")
    if size == 1:
        return 1
    if pp_stages > 1:
        # DeepSpeed's pipeline engine takes its own grid as mpu; the SP groups are another mpu (one per engine).
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size with pipeline.stages > 1 is not supported by DeepSpeed's pipeline "
            f"engine; use ds_configs/sp2_zero1.json or ds_configs/pp2_zero1.json"
        )
    if tp_size > 1:
        # AutoTP installs its own data x tensor mesh as the engine's mpu, which has no sequence dimension.
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size with tensor_parallel is not supported by DeepSpeed 0.19's AutoTP; "
            f"use ds_configs/sp2_zero1.json or ds_configs/tp2_zero1.json"
        )
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True) is False:
        # dstrain.train.engine.sequence.backward_factor corrects the one ZeRO-3 path that averages over the SP group.
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size with ZeRO-3 needs zero_optimization.reduce_scatter on (its default); "
            f"remove reduce_scatter: false"
        )
    model = recipe.model
    if model.attention_sinks:
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size with model.attention_sinks is not supported: after the all-to-all a "
            f"rank attends with a slice of the heads, whose sinks the core is not given; use a ZeRO config"
        )
    if model.rope_scaling is not None and model.rope_scaling.type == "longrope":  # issue 50
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size with model.rope_scaling longrope is not supported: it picks its "
            f"factors by the batch's largest position, which each rank sees only in its slice; use a ZeRO config"
        )
    if model.n_head % size:  # beyond the key/value heads, each rank repeats them (dstrain.train.engine.sequence)
        fits = [n for n in range(2, model.n_head + 1) if model.n_head % n == 0]
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size={size} does not divide the {model.n_head} query heads of "
            f"{recipe_file} (model.n_head); each rank attends with whole heads: pick one of {fits}"
        )
    if recipe.data.seq_len % size:
        raise DstrainError(
            f"{ds_file}: sequence_parallel_size={size} does not divide data.seq_len={recipe.data.seq_len} of "
            f"{recipe_file}; each rank holds an equal slice: pick a seq_len that is a multiple of {size}"
        )
    return size


def kv_replicas(n_head: int, kv_heads: int, sp_size: int) -> int:
    """How many copies of each key/value head SP exchanges: 1 where SP divides the key/value heads, else the fewest
    r dividing the group (n_head / kv_heads query heads per key/value head) with kv_heads·r a multiple of SP, so that
    rank i's n_head/sp query heads find their key/value heads among its kv_heads·r/sp (r = the group size, as many
    as the query heads, always does: SP divides the query heads)."""
    group = n_head // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and kv_heads * r % sp_size == 0)


def check_pipeline_accumulation(config: dict, ds_file: str, pp_stages: int, grad_accum: int) -> None:
    """DeepSpeed's DualPipeVEngine asserts gradient_accumulation_steps >= 2 x stages inside deepspeed.initialize."""
    if pp_stages > 1 and config["pipeline"].get("schedule") == "dualpipev" and grad_accum < 2 * pp_stages:
        micro = config["train_micro_batch_size_per_gpu"]
        samples = micro * grad_accum  # per data-parallel replica and step
        fits = [m for m in range(samples // (2 * pp_stages), 0, -1) if samples % m == 0]
        fix = f"set train_micro_batch_size_per_gpu to {fits[0]}" if fits else "raise the recipe's train.global_batch"
        raise DstrainError(
            f"{ds_file}: pipeline.schedule dualpipev needs at least 2 x pipeline.stages = {2 * pp_stages} "
            f"micro-batches per step, train_micro_batch_size_per_gpu={micro} gives {grad_accum}; {fix} or use "
            f"schedule 1f1b"
        )
