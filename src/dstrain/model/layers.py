"""The leaf pieces every attention of model/gpt.py and model/mla.py is built from: a Linear that initialises itself
(see model/gpt.py's docstring on zero.Init) and RoPE applied to (B, heads, L, dim) tensors (the angles:
model/rope.py)."""

from __future__ import annotations

import torch
from torch import nn


def normal_init(weight: torch.Tensor, std: float) -> None:
    """weight ~ normal(0, std) drawn from torch's CPU generator, then copied: the same numbers on every device.

    Under zero.Init the tensor is already on the accelerator, whose generator would draw other numbers, and ZeRO-3
    would start from other weights than every other strategy (seen on an H100: 1.5e-3 apart at step 1).
    """
    if weight.is_meta:  # parameter counting builds the model on the meta device: nothing to draw
        return
    with torch.no_grad():
        # device="cpu" is explicit: a `with torch.device(...)` block (and zero.Init) would otherwise place it there
        weight.copy_(torch.empty(weight.shape, dtype=torch.float32, device="cpu").normal_(0.0, std))


class Linear(nn.Linear):
    """nn.Linear drawing weight ~ normal(0, std) and zero bias; std=None leaves the weight to be tied."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float | None) -> None:
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        if self.std is not None:
            normal_init(self.weight, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, L, head_dim); cos/sin: (B|1, L, rotary_dim): the first rotary_dim dimensions rotate."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)
