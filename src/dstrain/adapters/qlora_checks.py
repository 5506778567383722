"""Where QLoRA (lora.quantize_base) runs, checked before anything is built: the model's layers, and the layouts
(dstrain.strategy.resolve calls it, so `dstrain plan` skips what `dstrain.train` would refuse). Torch-free."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.errors import DstrainError, InputError

if TYPE_CHECKING:
    from dstrain.config import Recipe

BLOCK = 64  # weights per block, one int8 scale each (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # block scales per second-level block (double quantization), one fp32 factor each
LUT_BYTES, MEAN_BYTES = 16 * 4, 4  # the 16 NF4 levels (fp32), the scales' mean (fp32)


def scaler_block(numel: int) -> int:
    """Block scales per fp32 factor: SCALER_BLOCK, or the largest divisor of the block count below it (torchao needs
    whole second-level blocks: a small test layer's 128 blocks take 128)."""
    return math.gcd(SCALER_BLOCK, numel // BLOCK)


def part_sizes(numel: int) -> list[int]:
    """Bytes of a packed NF4 weight's parts (dstrain.adapters.qlora.pack), in order: the 16 levels, the scales' mean,
    the factors (fp32 first, so that their views stay 4-byte aligned), the 4-bit codes, the int8 block scales."""
    blocks = numel // BLOCK
    return [LUT_BYTES, MEAN_BYTES, 4 * (blocks // scaler_block(numel)), numel // 2, blocks]


def packed_bytes(numel: int) -> int:
    """Bytes of one quantized weight of ``numel`` elements: 0.5 a weight, 1/64 for its block scale, 4/16384 for the
    second-level factor, and 68 bytes of constants (the levels and the scales' mean)."""
    return sum(part_sizes(numel))


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
        if fan_in * fan_out % BLOCK:
            raise DstrainError(
                f"{file}: lora.quantize_base: {name} ({fan_in} -> {fan_out}) is not a whole number of NF4 blocks of "
                f"{BLOCK} weights; remove lora.quantize_base"
            )


def check_quantized_layout(recipe: Recipe, tp: int, pp: int, offload_param: bool) -> None:
    """QLoRA runs on data parallelism, ZeRO 0-3 (with optimizer offload) and Ulysses sequence parallelism. Refused:
    AutoTP (it slices nn.Linear weights, and an NF4 layer's bytes are no matrix to slice), pipeline stages (the
    stages are built layer by layer, and the quantizer is not applied per stage) and ZeRO-3 parameter offload (not
    tested with the packed bytes)."""
    if recipe.lora is None or recipe.lora.quantize_base is None:
        return
    for refused, what in ((tp > 1, "tensor_parallel"), (pp > 1, "pipeline"), (offload_param, "offload_param")):
        if refused:
            raise InputError(
                f"{what} with lora.quantize_base (QLoRA): the NF4 base runs on ZeRO 0-3 data parallelism "
                f"and Ulysses only; pick such a ds_config or remove lora.quantize_base"
            )
