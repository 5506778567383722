"""The GPT as a DeepSpeed `PipelineModule`: the same Embedding / Block / norm / head, cut into stages.

The pipeline is a flat list of layers, each a thin wrapper around a module of `gpt.py` that passes
what the next stage needs: a hidden-state tensor, or `(hidden, position_ids)` when doc masking is on.

    layer 0          embedding   (a TiedLayerSpec "embed" when the head is tied to it)
    layers 1..n      blocks
    layer n+1        final norm
    layer n+2        head        (the tied embedding's weight, or its own Linear)

With a chunked loss (``head_loss``) the head layer hands the loss its input and weight instead of the logits, and
the loss applies the head tile by tile (dstrain.train.engine.tiling): the last stage never holds the whole logits.

Initial weights equal `GPT(config)`'s for the same seed: each layer is built from the CPU RNG state
the plain constructor had when it reached that layer (recorded by building the layers once, in order,
one at a time), so a stage that builds only its own layers still draws exactly the plain model's
numbers. `layer_prefixes` names where each layer's parameters live in the plain state dict; the
converter in `dstrain.checkpoint.consolidate` uses it in both directions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from dstrain.model.config import GPTConfig
from dstrain.model.gpt import Block, Embedding, Head, make_norm, soft_cap, token_loss_sum

TIED_KEY = "embed"


class EmbeddingPipe(Embedding):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.logit_softcap = config.logit_softcap  # the tied head's soft cap (tied_head)

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            input_ids, position_ids = inputs
            return super().forward(input_ids, position_ids), position_ids
        return super().forward(inputs)


class BlockPipe(Block):
    def forward(self, inputs):
        if isinstance(inputs, tuple):
            x, position_ids = inputs
            return super().forward(x, position_ids), position_ids
        return super().forward(inputs)


class FinalNormPipe(nn.Module):
    """GPT.norm; drops the position ids, which no later layer needs."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = make_norm(config)

    def forward(self, inputs):
        return self.norm(inputs[0] if isinstance(inputs, tuple) else inputs)


class HeadPipe(Head):
    """An untied GPT.lm_head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config, std=config.init_std)


class HeadInputPipe(HeadPipe):
    """An untied GPT.lm_head whose loss applies it: (its input, its weight)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return x, self.weight


def tied_head(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """GPT.lm_head when tied: logits from the token embedding's own weight (soft-capped as the model says)."""
    return soft_cap(F.linear(x, embedding.tok.weight), embedding.logit_softcap)


def tied_head_input(embedding: EmbeddingPipe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tied GPT.lm_head whose loss applies it: (its input, the token embedding's weight)."""
    return x, embedding.tok.weight


class _SeededLayerSpec(LayerSpec):
    """A LayerSpec that builds its module from a recorded CPU RNG state (see the module docstring)."""

    rng_state: torch.Tensor

    def build(self, log=False):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng_state)
            return super().build(log)


class _SeededTiedLayerSpec(_SeededLayerSpec, TiedLayerSpec):
    pass


def layer_specs(config: GPTConfig, seed: int, head_input: bool = False) -> list[LayerSpec]:
    """The pipeline's layers in GPT order, each seeded to draw what GPT(config) draws for it; ``head_input``: the
    head layer passes (its input, its weight) to the loss instead of the logits."""

    def spec(typename, tied_fn=None, tied=False, *args):
        if tied:
            return _SeededTiedLayerSpec(TIED_KEY, typename, config, forward_fn=tied_fn, tied_weight_attr=["tok.weight"])
        return _SeededLayerSpec(typename, config, *args)

    specs = [spec(EmbeddingPipe, tied=config.tied)]
    specs += [spec(BlockPipe, None, False, i) for i in range(config.n_layer)]  # each block its kind (layer_types)
    specs.append(spec(FinalNormPipe))
    if config.tied:
        specs.append(spec(EmbeddingPipe, tied_head_input if head_input else tied_head, tied=True))
    else:
        specs.append(spec(HeadInputPipe if head_input else HeadPipe))
    # Replay GPT.__init__'s draws layer by layer; the tied head draws nothing there, like GPT's tied lm_head.
    torch.manual_seed(seed)
    for s in specs:
        if isinstance(s, TiedLayerSpec) and s is not specs[0]:
            s.rng_state = specs[0].rng_state
            continue
        s.rng_state = torch.get_rng_state()
        s.typename(*s.module_args)  # consume this layer's init; the module is dropped
    return specs


def layer_prefixes(config: GPTConfig) -> list[tuple[str, str] | None]:
    """Per pipeline layer: (prefix of its keys in GPT.state_dict(), prefix of the same keys in the layer's own
    state dict); None for the tied head, whose weight is the embedding's."""
    head = None if config.tied else ("lm_head.", "")
    return [("embed.", ""), *((f"blocks.{i}.", "") for i in range(config.n_layer)), ("norm.", "norm."), head]


class PipeLoss:
    """The pipeline's loss function: the micro-batch's mean loss, or during a train step its loss sum over
    ``divisor``, the step's learned tokens per micro-batch, which the trainer sets (dstrain.train.step.steps).
    ``head_loss``: the loss sum when the head layer hands over (its input, its weight) (the chunked loss)."""

    def __init__(self, head_loss: Callable | None = None) -> None:
        self.divisor: float | None = None
        self.head_loss = head_loss

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        losses = token_loss_sum(outputs, labels) if self.head_loss is None else self.head_loss(outputs, labels)
        if self.divisor is None:
            return losses / (labels != -100).sum().clamp(min=1).to(losses.dtype)
        return losses / self.divisor


def build_pipeline(
    config: GPTConfig,
    seed: int,
    stages: int,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
    schedule: str = "1f1b",
    head_loss: Callable | None = None,
) -> PipelineModule:
    """GPT(config) as a PipelineModule of `stages` stages, with PipeLoss as its loss; ``head_loss((hidden, weight),
    labels)``: a loss sum that applies the head itself (the chunked loss), in place of the logits' token_loss_sum.

    schedule "dualpipev" builds DeepSpeed's DualPipeVModule instead: the layers cut into 2 x `stages` stages, rank r
    holding stage r and its mirror 2 x stages - 1 - r, so rank 0 holds the embedding, the head and the loss
    (deepspeed.initialize then runs the DualPipeV schedule).
    """
    module = DualPipeVModule if schedule == "dualpipev" else PipelineModule
    return module(
        layers=layer_specs(config, seed, head_input=head_loss is not None),
        num_stages=stages,
        loss_fn=PipeLoss(head_loss),
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        # Only blocks: DeepSpeed's reentrant checkpoint would cut the embedding off from its gradient.
        checkpointable_layers=[BlockPipe.__name__],
    )


__all__ = [
    "build_pipeline",
    "layer_prefixes",
    "layer_specs",
    "EmbeddingPipe",
    "BlockPipe",
    "FinalNormPipe",
    "HeadPipe",
    "HeadInputPipe",
    "tied_head",
    "tied_head_input",
]
