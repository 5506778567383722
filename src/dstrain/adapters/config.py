"""The recipe's ``lora:`` section, low-rank adapters on the frozen model, and its checks against the model it adapts.

dstrain.adapters.lora applies them (docs/adapters.md). No torch: `dstrain estimate` and `plan` read it too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from dstrain.errors import DstrainError
from dstrain.ranges import Range

if TYPE_CHECKING:
    from dstrain.model.config import GPTConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention's projections (model/gpt.py's Attention)
MLP = ("gate_proj", "up_proj", "down_proj")  # the MLP's projections (gpt2 has no gate_proj)
TargetModule = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "all-linear"]
SavedModule = Literal["embed_tokens", "lm_head"]


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021) as PEFT defines it: each targeted linear layer W (frozen) computes W x + s B A dropout(x)
    with A (rank x in) drawn as PEFT draws it (kaiming-uniform, a = sqrt(5)), B (out x rank) zero, and the scale
    s = alpha / rank (rsLoRA: alpha / sqrt(rank)). Only A, B and the modules_to_save train; every other parameter of
    the model is frozen: no gradient, no optimizer state, bit-for-bit the same after training."""

    rank: Annotated[int, Range(ge=1)] = 8  # r: the adapters' inner width; at most the smaller side of every target
    alpha: Annotated[float, Range(gt=0)] = 16.0  # lora_alpha: the update is scaled by alpha / rank
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0  # lora_dropout on the adapter's input (not on W x)
    # which linear layers of every block take an adapter, by their (Hugging Face) names: the attention's q_proj,
    # k_proj, v_proj, o_proj, the MLP's gate_proj, up_proj, down_proj; all-linear: every one the model has (never
    # lm_head, as PEFT's all-linear)
    target_modules: list[TargetModule] = field(default_factory=lambda: ["all-linear"])
    # whole modules trained beside the adapters and saved with them, as PEFT's modules_to_save: embed_tokens (the
    # token embedding), lm_head (the output head; with tied embeddings the one shared matrix)
    modules_to_save: list[SavedModule] = field(default_factory=list)
    use_rslora: bool = False  # rank-stabilised LoRA (Kalajdzievski 2023): scale alpha / sqrt(rank)
    # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) trained on the recipe's init_from, to
    # continue training it; its rank, alpha and targets must be these. None: fresh adapters (B = 0)
    init_from: str | None = None
    # QLoRA: the frozen base's block linear layers stored in 4-bit NormalFloat with double-quantized block scales
    # (torchao's NF4: 0.52 byte a weight; the embeddings, norms and head stay in the training precision) and computed
    # in the training precision; None keeps the base in the training precision (docs/adapters.md#qlora)
    quantize_base: Literal["nf4"] | None = None

    @property
    def scale(self) -> float:
        """The factor on B A x."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


def target_names(lora: LoraConfig, model: GPTConfig) -> tuple[str, ...]:
    """The projection names ``lora`` adapts on ``model``, in the model's order (all-linear resolved)."""
    present = ATTENTION + (MLP if model.flavour == "llama" else MLP[1:])
    wanted = set(present) if "all-linear" in lora.target_modules else set(lora.target_modules)
    return tuple(name for name in present if name in wanted)


def layer_shapes(model: GPTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a (dense, multi-head) block."""
    d, heads, kv = model.d_model, model.n_head * model.head_dim, model.kv_heads * model.head_dim
    ff = model.ff_dim
    return {
        "q_proj": (d, heads),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (heads, d),
        "gate_proj": (d, ff),
        "up_proj": (d, ff),
        "down_proj": (ff, d),
    }


def check_lora(lora: LoraConfig, model: GPTConfig, file: Path | str) -> None:
    """The ``lora:`` section against the model it adapts: one line naming the key and the fix."""
    asked = [name for name in lora.target_modules if name != "all-linear"]
    present = target_names(LoraConfig(target_modules=["all-linear"]), model)
    for name in asked:
        if name not in present:
            raise DstrainError(
                f"{file}: lora.target_modules names {name}, which the {model.flavour} model does not have; "
                f"use some of {', '.join(present)} or all-linear"
            )
    if len(set(lora.target_modules)) != len(lora.target_modules) or not lora.target_modules:
        raise DstrainError(f"{file}: lora.target_modules must name each module once, at least one")
    targets = target_names(lora, model)
    if model.mla is not None and set(targets) & set(ATTENTION):
        raise DstrainError(
            f"{file}: lora.target_modules: model.mla's latent attention has no q/k/v/o projections to adapt; "
            f"target the MLP's ({', '.join(MLP)})"
        )
    if model.moe is not None and set(targets) & set(MLP):
        raise DstrainError(
            f"{file}: lora.target_modules: the experts' linear layers of model.moe are not adapted; "
            f"target the attention's projections ({', '.join(ATTENTION)}) only"
        )
    shapes = layer_shapes(model)
    for target in targets:
        fan_in, fan_out = shapes[target]
        if lora.rank > min(fan_in, fan_out):
            raise DstrainError(
                f"{file}: lora.rank={lora.rank} is larger than {target} ({fan_in} -> {fan_out}); "
                f"set lora.rank <= {min(fan_in, fan_out)}"
            )
    if len(set(lora.modules_to_save)) != len(lora.modules_to_save):
        raise DstrainError(f"{file}: lora.modules_to_save names a module twice; name each once")


def adapter_params(lora: LoraConfig, model: GPTConfig) -> int:
    """The parameters that train under ``lora``: rank x (in + out) per adapted projection, and modules_to_save."""
    shapes = layer_shapes(model)
    per_block = sum(lora.rank * sum(shapes[target]) for target in target_names(lora, model))
    saved = len(lora.modules_to_save) * model.vocab_size * model.d_model
    if model.tied and len(lora.modules_to_save) == 2:
        saved //= 2  # embed_tokens and lm_head are one matrix
    return model.n_layer * per_block + saved
