"""The ds_config's optimizer section, filled from the recipe: which optimizer is the recipe's (optim.kind), how it
is implemented the ds_config's (torch_adam, fused, CPU Adam under offload), and the strategies Muon is refused under.

With ``optim.kind: muon`` the section's "AdamW" becomes DeepSpeed's "Muon" (MuonWithAuxAdam): its AdamW half keeps the
ds_config's implementation switches, its Muon half takes ``muon_lr``, ``momentum`` and ``ns_method`` from the recipe.
"""

from __future__ import annotations

from collections.abc import Callable

from dstrain.config import Recipe
from dstrain.errors import InputError
from dstrain.precision import Precision

MUON = "Muon"
ADAM_TYPES = ("adam", "adamw")  # what a ds_config may name as the implementation of Muon's AdamW half
ACCEPTED = (
    "ds_configs/zero0.json, zero1.json, zero2.json, sp2_zero1.json, zero1_bf16.json, or zero3.json or zero3_bf16.json "
    "with reduce_scatter: false"
)
ACCEPTED_WITH_MOE = "ds_configs/zero0.json, zero1.json, zero2.json or ep2_zero1.json (fp32: tests/test_muon_moe.py)"

# bf16 ZeRO-1 is DeepSpeed's BF16_Optimizer, whose constructor raises "BF16 Muon currently requires FP32 accumulation,
# dense DP and eager execution" when the model has MoE layers (deepspeed/runtime/bf16_optimizer.py; canary:
# tests/test_muon_moe.py::test_deepspeeds_bf16_optimizer_refuses_muon_with_moe_layers); bf16 ZeRO-2 is refused for
# every Muon model (optimizer_refusal). Where it ends, zero1_bf16 with model.moe can be proven as the dense one was.
MUON_MOE_IN_BF16 = "DeepSpeed 0.19.8's bf16 optimizer refuses Muon with MoE layers: Muon with model.moe trains in fp32"


def fill_optimizer(config: dict, recipe: Recipe, fill: Callable) -> None:
    """The optimizer's type and hyper-parameters from the recipe; ``fill(section, key, value, owner)`` sets a value
    the recipe owns (resolve._fill: "auto" or absent is filled, a different pin is an error)."""
    o = recipe.optim
    section = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
    named = str(section.get("type", "AdamW"))
    if o.kind == "adamw" and named.lower() == MUON.lower():
        raise InputError(
            f'optimizer.type "{named}" but the recipe sets optim.kind=adamw; the recipe owns the '
            f'optimizer: set optimizer.type to "AdamW" and optim.kind: muon in the recipe for Muon'
        )
    if o.kind == "muon":
        if named.lower() not in (*ADAM_TYPES, MUON.lower()):
            raise InputError(
                f'optimizer.type "{named}" cannot run optim.kind=muon of the recipe; use "AdamW" '
                f"(Muon's AdamW half: embeddings, head, norms, biases)"
            )
        section["type"] = MUON
    params = section.setdefault("params", {})
    for key, value, owner in [
        ("lr", o.lr, "optim.lr"),
        ("betas", list(o.betas), "optim.betas"),
        ("eps", o.eps, "optim.eps"),
        ("weight_decay", o.weight_decay, "optim.weight_decay"),
    ]:
        fill(params, key, value, owner)
    if o.kind == "muon":
        for key, value, owner in [
            ("adam_lr", o.lr, "optim.lr"),
            ("muon_lr", o.muon.lr, "optim.muon.lr"),
            ("momentum", o.muon.momentum, "optim.muon.momentum"),
            ("ns_method", o.muon.ns_method, "optim.muon.ns_method"),
        ]:
            fill(params, key, value, owner)


def check_muon(
    recipe: Recipe, config: dict, stage: int, precision: Precision, sizes: tuple[int, int, int, int]
) -> None:
    """Refuse, before launch and in one line, the strategies under which Muon would not be the math of ZeRO-0 fp32:
    the raw gradient clipped by its global norm, then momentum and Newton-Schulz on the whole matrix."""
    if recipe.optim.kind != "muon":
        return
    zero = config["zero_optimization"]
    offload = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    reason = optimizer_refusal(stage, precision, offload) or layout_refusal(recipe, precision, sizes)
    if stage == 3 and sizes[2] > 1:  # resolve's sequence-parallel check needs reduce_scatter on, DeepSpeed's Muon off
        reason = "sequence parallelism with ZeRO-3 needs reduce_scatter, which DeepSpeed 0.19.8's ZeRO-3 Muon refuses"
    if reason:
        accepted = ACCEPTED if recipe.model.moe is None else ACCEPTED_WITH_MOE
        raise InputError(f"optim.kind=muon is refused: {reason}; use {accepted}")
    if stage == 3 and zero.get("reduce_scatter", True):  # DeepSpeed 0.19.8 raises at init otherwise (stage3.py)
        raise InputError(
            "optim.kind=muon under ZeRO-3 needs zero_optimization.reduce_scatter: false (DeepSpeed 0.19.8 "
            'runs Muon only on all-reduced gradients there); add "reduce_scatter": false to zero_optimization'
        )


def optimizer_refusal(stage: int, precision: Precision, offload: bool) -> str | None:
    """Why the ZeRO optimizer DeepSpeed builds for (stage, precision, offload) would not clip Muon's raw gradient."""
    if stage == 1 and precision == "bf16" and not offload:
        # DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1, fp32 accumulation): it takes the norm of the raw fp32 gradient,
        # clips it, and only then runs Muon on whole matrices (bf16_optimizer.step, _prepare_muon_updates).
        return None
    if (stage > 0 and precision == "fp32" or stage == 3 and precision == "bf16") and not offload:
        # DeepSpeed's ZeRO optimizers clip the orthogonalised update; train/engine/muon_zero.py makes them clip the raw
        # gradient. bf16 ZeRO-3 accumulates every gradient in its fp32 partitions.
        return None
    if offload:
        # stage_1_and_2 / stage3 ._apply_muon_updates_cpu_offload orthogonalise before the norm and clip the
        # orthogonalised update, on a path train/engine/muon_zero.py does not take.
        return f"under ZeRO stage {stage} with offload DeepSpeed 0.19.8 clips Muon's orthogonalised update"
    if stage == 2 and precision == "bf16":
        # stage_1_and_2._muon_momentum_buffer: at stage 2 the Muon matrices' gradients stay in the parameters' dtype
        # (measured: the step-1 norm 1.7e-4 from fp32's, twice zero1_bf16's 7.5e-5).
        return "bf16 ZeRO-2 hands Muon bf16 gradients (no fp32 accumulation for its matrices)"
    if stage > 0:
        return f"{precision} under ZeRO stage {stage} is not proven with Muon here"
    if precision != "fp32":
        return f"{precision} at ZeRO-0 is not accepted here; bf16 Muon runs under ds_configs/zero1_bf16.json"
    return None


def layout_refusal(recipe: Recipe, precision: Precision, sizes: tuple[int, int, int, int]) -> str | None:
    """Why a model-parallel layout would not give ZeRO-0's Muon. Sequence parallelism (fp32) does: each rank's
    gradient is the data-parallel one (tests/test_muon.py); so does expert parallelism (fp32)."""
    tp_size, pp_stages, sp_size, ep_size = sizes
    if precision == "bf16" and recipe.model.moe is not None:
        return MUON_MOE_IN_BF16
    if precision == "bf16" and tp_size * pp_stages * sp_size * ep_size > 1:
        return "DeepSpeed's bf16 Muon takes dense data parallelism only (no TP, PP, SP, MoE)"
    if pp_stages > 1:
        # deepspeed.set_optimizer_flags picks Muon's parameters by name ("embed", "lm_head"), which a
        # PipelineModule's layers ("0.tok.weight") do not carry: the embedding and head would take Muon.
        return "DeepSpeed picks Muon's matrices by name, and a pipeline's layer names would put the embedding in"
    if tp_size > 1:
        return "tensor parallelism shards the matrices, and Newton-Schulz on a shard is not Newton-Schulz on the whole"
    # model.moe in fp32 at ZeRO-0/1/2, EP1 or EP2 (ZeRO-3 and pipelines are refused for MoE by parallel.py): each
    # routed expert of DeepSpeed's classic MoE layer is its own 2-D matrix, and Muon orthogonalises it alone, on the
    # gradient averaged over the expert-data-parallel group (tests/test_muon_moe.py).
    return None
