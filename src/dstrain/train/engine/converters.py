"""Model converters: what is applied to the built model from outside the model file, before deepspeed.initialize
(adapters now, FP8 later), as the parallel layouts are (dstrain.train.engine.layouts). Each declares which of the
model's parameters train; the rest are frozen. A converter is one line in ``converters_for``; with none, the model
is handed on untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dstrain.config import Recipe
from dstrain.strategy.resolve import Strategy
from dstrain.train.engine import adapters


class ModelConverter(Protocol):
    """Applied to the built model from outside the model file, before deepspeed.initialize (adapters now, FP8 later)."""

    name: str

    def convert(self, model: torch.nn.Module, strategy: Strategy) -> torch.nn.Module: ...

    def trainable(self, name: str) -> bool: ...  # which parameters train; the rest get requires_grad=False


# One line per converter, in the order they are applied: the recipe asks for it when the builder returns one.
REGISTRY: list[Callable[[Recipe], ModelConverter | None]] = [
    adapters.lora_converter,  # lora: (dstrain.adapters)
    adapters.quantize_base_converter,  # lora.quantize_base: QLoRA's NF4 base, after LoRA's adapters hooked it
]


def converters_for(recipe: Recipe) -> list[ModelConverter]:
    """The converters ``recipe`` asks for, in the order they are applied."""
    return [converter for build in REGISTRY if (converter := build(recipe)) is not None]


def apply_converters(model: torch.nn.Module, recipe: Recipe, strategy: Strategy) -> torch.nn.Module:
    """Each converter in turn, then every parameter that no converter trains is frozen (requires_grad=False).
    With no converter the model is returned as it came: all of it trains."""
    converters = converters_for(recipe)
    if not converters:
        return model
    for converter in converters:
        model = converter.convert(model, strategy)
    for name, param in model.named_parameters():
        if not any(converter.trainable(name) for converter in converters):
            param.requires_grad_(False)
    return model
