"""Building the DeepSpeed engine: the model (under zero.Init for ZeRO-3), parameter groups, schedule."""
from __future__ import annotations

import contextlib

import deepspeed
import torch

from dstrain.config import Recipe
from dstrain.model.gpt import GPT
from dstrain.strategy import Strategy
from dstrain.train.schedule import build_scheduler


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases (1-D tensors) are not decayed."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_model(recipe: Recipe, strategy: Strategy) -> torch.nn.Module:
    """The plain GPT; under ZeRO-3 built inside zero.Init so no rank ever holds all of it."""
    torch.manual_seed(recipe.seed)  # identical initial weights on every rank and under every strategy
    init = (
        deepspeed.zero.Init(config_dict_or_path=strategy.ds_config)
        if strategy.zero_stage == 3
        else contextlib.nullcontext()
    )
    with init:
        return GPT(recipe.model)


def build_engine(recipe: Recipe, strategy: Strategy, model: torch.nn.Module):
    """deepspeed.initialize with the optimizer from the ds_config and the schedule from the recipe."""
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, recipe.optim.weight_decay),
        config=strategy.ds_config,
        lr_scheduler=lambda opt: build_scheduler(opt, recipe.total_steps, recipe.optim, recipe.schedule),
    )
    return engine
