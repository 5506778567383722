"""QLoRA: the frozen base's linear layers stored in 4-bit NormalFloat (NF4) with double-quantized block scales, the
compute in the training precision (Dettmers and others, 2023). A model converter: applied to the built GPT from outside
model/gpt.py, after the adapters froze the base (dstrain.adapters.lora) and init_from filled it.

The format and its arithmetic are torchao's (``NF4Tensor``: blocks of 64 weights, one int8 scale per block, the
scales quantized again in blocks of 256 against an fp32 factor): pure PyTorch, so it runs on any accelerator and on
the CPU the tests run on. bitsandbytes 0.50 runs on this CPU too, but its ``Params4bit`` replaces each linear module
(``Linear4bit``) and changes the weight's shape to packed bytes, and its CPU path is a separate backend from the CUDA
kernels the cluster would run; torchao's one code path is what the CPU tests prove. docs/adapters.md ("QLoRA").

Each quantized layer keeps its bytes in one frozen uint8 parameter (torchao's NF4 tensor's parts, end to end), not in
an NF4Tensor: DeepSpeed casts floating parameters to the training dtype, broadcasts them and (ZeRO-3) flattens and
partitions them as plain tensors, none of which a tensor subclass survives. As uint8 the bytes are neither cast nor
rounded; ZeRO-3 partitions and gathers them like any parameter (grouped by dtype: 0.5 byte a weight on the wire),
and the forward rebuilds torchao's NF4Tensor around the gathered bytes (views, no copy) and runs torchao's
``linear_nf4``: the weight dequantized to the input's dtype for the matmul, never kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

# NF4's layout and its byte count live with the torch-free checks (dstrain.plan counts with them too)
from dstrain.adapters.qlora_checks import BLOCK, packed_bytes, part_sizes, scaler_block

__all__ = ["BLOCK", "NF4Linear", "pack", "packed_bytes", "quantize_base", "quantize_built_model"]


def _nf4():
    # torchao 0.18 moved the module; the old path (torchao.dtypes.nf4tensor) is gone there
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def pack(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 of ``weight`` (quantized from fp32), its parts end to end as one uint8 tensor."""
    numel = weight.numel()
    if numel % BLOCK:
        raise ValueError(f"NF4 needs a multiple of {BLOCK} weights, not {tuple(weight.shape)}")
    nf4 = _nf4().to_nf4(weight.detach().float(), BLOCK, scaler_block(numel))
    floats = [nf4.nf4, nf4.scaler_mean.reshape(1), nf4.quantization_factor.reshape(-1)]
    # copied into fresh fp32 tensors: torchao's may be strided views, which do not view as bytes
    parts = [torch.empty(t.numel(), dtype=torch.float32).copy_(t.reshape(-1)).view(torch.uint8) for t in floats]
    parts += [nf4.quantized_data.reshape(-1), nf4.quantized_scalers.reshape(-1).view(torch.uint8)]
    assert [p.numel() for p in parts] == part_sizes(numel)
    return torch.cat(parts)


def nf4_view(packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype):
    """torchao's NF4Tensor over packed bytes (pack's; views, no copy), dequantizing to ``dtype``."""
    nf4_tensor = _nf4()
    numel = out_features * in_features
    lut, mean, factor, data, scalers = torch.split(packed, part_sizes(numel))
    shape = torch.Size((out_features, in_features))
    meta = nf4_tensor.SubclassTensorArgs(shape, (in_features, 1), 0, dtype, packed.device, False)
    return nf4_tensor.NF4Tensor(
        meta,
        BLOCK,
        numel // BLOCK,
        scaler_block(numel),
        scalers.view(torch.int8),
        factor.view(torch.float32),
        mean.view(torch.float32).reshape(()),
        data,
        lut.view(torch.float32),
    )


def dequantized_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A consolidated QLoRA checkpoint's state dict with each NF4 projection (its packed bytes) dequantized to the
    dtype of the rest (the weights the run computed with), for the merged export; other tensors as they are."""
    from dstrain.adapters.config import layer_shapes

    shapes = layer_shapes(config)
    dtype = state["embed.tok.weight"].dtype
    out = dict(state)
    for name, tensor in state.items():
        if tensor.dim() == 1 and name.startswith("blocks.") and name.endswith("_proj.weight"):
            fan_in, fan_out = shapes[name.rsplit(".", 2)[-2]]
            packed = tensor.to(torch.uint8)  # consolidation (zero_to_fp32) hands the bytes back as exact floats
            out[name] = nf4_view(packed, fan_out, fan_in, torch.float32).get_original_weight().to(dtype)
    return out


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is torchao's NF4, packed in one uint8 parameter; the bias (if any) as was."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor | None = None) -> None:
        """``packed``: pack(linear.weight), made beforehand where this runs inside ZeRO-3's zero.Init (which turns
        every floating tensor made inside it into the training dtype, torchao's arithmetic included)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        numel = self.in_features * self.out_features
        self.scaler_block = scaler_block(numel)
        self.sizes = part_sizes(numel)
        packed = pack(linear.weight) if packed is None else packed
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def nf4_weight(self, dtype: torch.dtype):
        """torchao's NF4Tensor over this layer's bytes (views), dequantizing to ``dtype``."""
        return nf4_view(self.weight, self.out_features, self.in_features, dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.nf4_weight(torch.float32).get_original_weight().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _nf4().linear_nf4(x, self.nf4_weight(x.dtype))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4 (torchao)"


def quantize_base(
    model: nn.Module, gathered: Callable | None = None, init: Callable | None = None, prefix: str = "blocks."
) -> list[str]:
    """Replace every frozen nn.Linear under ``prefix`` (the blocks: never the embeddings or the head) by an NF4Linear;
    the names replaced, in order. ``gathered(params)`` and ``init()``: ZeRO-3's GatheredParameters and zero.Init
    contexts (one layer whole at a time, its packed bytes partitioned as they are made); None on other layouts."""
    gathered = gathered or (lambda params: contextlib.nullcontext())
    init = init or contextlib.nullcontext
    names = []
    for name, module in list(model.named_modules()):
        if not name.startswith(prefix) or type(module) not in (nn.Linear,) and not _is_plain_linear(module):
            continue
        if module.weight.requires_grad:  # an adapter's A or B, or a layer left trainable
            continue
        parent_name, _, child = name.rpartition(".")
        with gathered([module.weight]):
            packed = pack(module.weight)
        with init():
            quantized = NF4Linear(module, packed)
        setattr(model.get_submodule(parent_name), child, quantized)
        names.append(name)
    return names


def quantize_built_model(model: nn.Module, ds_config: dict, zero3: bool) -> list[str]:
    """quantize_base on the engine's model before deepspeed.initialize: under ZeRO-3 (built inside zero.Init) each
    layer is gathered whole once and its packed bytes are partitioned as they are made."""
    if not zero3:
        return quantize_base(model)
    import deepspeed

    return quantize_base(
        model,
        gathered=lambda params: deepspeed.zero.GatheredParameters(params),
        init=lambda: deepspeed.zero.Init(config_dict_or_path=ds_config),
    )


def _is_plain_linear(module: nn.Module) -> bool:
    """dstrain's own Linear (model/layers.py) is an nn.Linear with its own initialisation only."""
    from dstrain.model.layers import Linear

    return type(module) is Linear
