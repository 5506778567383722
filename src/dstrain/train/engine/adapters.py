"""The adapters as model converters (dstrain.train.engine.converters): LoRA's adapters on the recipe's lora: targets
with the base frozen (dstrain.adapters)."""

from __future__ import annotations

import contextlib

import torch

from dstrain.config import Recipe
from dstrain.strategy.resolve import Strategy


class LoraConverter:
    """LoRA's adapters (dstrain.adapters.lora) on the targets of the recipe's lora: section; the base frozen."""

    name = "lora"

    def __init__(self, recipe: Recipe) -> None:
        assert recipe.lora is not None
        self.recipe, self.lora = recipe, recipe.lora

    def convert(self, model: torch.nn.Module, strategy: Strategy) -> torch.nn.Module:
        from dstrain.adapters.lora import inject

        # Under ZeRO-3 the adapters are built inside zero.Init like the model (build_model): partitioned as built,
        # each rank drawing the same numbers (each adapter's own CPU generator).
        init = contextlib.nullcontext()
        if strategy.zero_stage == 3:
            import deepspeed

            init = deepspeed.zero.Init(config_dict_or_path=strategy.deepspeed_config)
        with init:
            inject(model, self.recipe.model, self.lora, self.recipe.seed, strategy.tp_size > 1)
        if self.lora.init_from:
            from dstrain.adapters.peft_format import load_adapter_into

            load_adapter_into(model, self.lora.init_from, self.recipe, strategy.zero_stage == 3)
        if strategy.activation_checkpointing:
            keep_block_inputs_differentiable(model)
        return model

    def trainable(self, name: str) -> bool:
        from dstrain.adapters.lora import is_adapter, saved_module_names

        return is_adapter(name) or name in saved_module_names(self.lora)


def keep_block_inputs_differentiable(model: torch.nn.Module) -> None:
    """With the embedding frozen no block input requires a gradient, and a reentrant activation checkpoint (DeepSpeed's)
    then hands back an output without one: the adapters inside would never learn. The embedding's output is marked
    as requiring one, as transformers' enable_input_require_grads does for PEFT."""
    from dstrain.model.gpt import Embedding

    def require_grad(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # a pipeline's embedding: (hidden, positions)
        if torch.is_grad_enabled() and not hidden.requires_grad:
            hidden.requires_grad_(True)

    for module in model.modules():
        if isinstance(module, Embedding):
            module.register_forward_hook(require_grad)


class QuantizeBaseConverter:
    """QLoRA: the frozen base's block linear layers to torchao's NF4 (dstrain.adapters.qlora), after LoRA froze them
    (its adapters hook whatever module holds a target's name, so they add to the NF4 layer's output)."""

    name = "lora.quantize_base"

    def convert(self, model: torch.nn.Module, strategy: Strategy) -> torch.nn.Module:
        from dstrain.adapters.qlora import quantize_built_model

        quantize_built_model(model, strategy.deepspeed_config, strategy.zero_stage == 3)
        return model

    def trainable(self, name: str) -> bool:
        return False  # the NF4 bytes never train


def lora_converter(recipe: Recipe) -> LoraConverter | None:
    return LoraConverter(recipe) if recipe.lora is not None else None


def quantize_base_converter(recipe: Recipe) -> QuantizeBaseConverter | None:
    return QuantizeBaseConverter() if recipe.lora is not None and recipe.lora.quantize_base is not None else None
