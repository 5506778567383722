"""Where QLoRA (lora.quantize_base) runs, checked before anything is built: the model's layers, and the layouts
(dstrain.strategy.resolve calls it, so `dstrain plan` skips what `dstrain.train` would refuse). Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.errors import DstrainError

if TYPE_CHECKING:
    from dstrain.config import Recipe

NF4_BLOCK = 64  # weights per NF4 block (dstrain.adapters.qlora.BLOCK)


def check_quantized_model(recipe: Recipe, file: Path | str) -> None:
    """The model QLoRA quantizes: dense blocks whose projections hold whole NF4 blocks."""
    from dstrain.adapters.config import layer_shapes

    if recipe.lora is None or recipe.lora.quantize_base is None:
        return
    model = recipe.model
    if model.moe is not None or model.mla is not None:
        kind = "model.moe's experts" if model.moe is not None else "model.mla's latent attention"
        raise DstrainError(f"{file}: lora.quantize_base: {kind} is not quantized (dense blocks only); remove it")
    for name, (fan_in, fan_out) in layer_shapes(model).items():
        if fan_in * fan_out % NF4_BLOCK:
            raise DstrainError(
                f"{file}: lora.quantize_base: {name} ({fan_in} -> {fan_out}) is not a whole number of NF4 blocks of "
                f"{NF4_BLOCK} weights; remove lora.quantize_base"
            )


def check_quantized_layout(recipe: Recipe, ds_file: str, tp: int, pp: int, offload_param: bool) -> None:
    """QLoRA runs on data parallelism, ZeRO 0-3 (with optimizer offload) and Ulysses sequence parallelism. Refused:
    AutoTP (it slices nn.Linear weights, and an NF4 layer's bytes are no matrix to slice), pipeline stages (the
    stages are built layer by layer, and the quantizer is not applied per stage) and ZeRO-3 parameter offload (not
    tested with the packed bytes)."""
    if recipe.lora is None or recipe.lora.quantize_base is None:
        return
    for refused, what in ((tp > 1, "tensor_parallel"), (pp > 1, "pipeline"), (offload_param, "offload_param")):
        if refused:
            raise DstrainError(
                f"{ds_file}: {what} with lora.quantize_base (QLoRA): the NF4 base runs on ZeRO 0-3 data parallelism "
                f"and Ulysses only; pick such a ds_config or remove lora.quantize_base"
            )
