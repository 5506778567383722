"""Sequence tiling (ds_config ``"tiling": {"loss": n, "mlp": m}``): memory, not math.

The loss is computed n sequence tiles at a time, so the (tokens x vocabulary) logits, their fp32 log-probabilities
and their gradient exist for one tile only; each MLP runs m tiles at a time, so its (tokens x d_ff) intermediates do.
Both recompute their tile in the backward (DeepSpeed's SequenceTiledCompute and TiledMLP, from Arctic Long Sequence
Training). DeepSpeed's TiledFusedLogitsLoss is not used: it computes the head's gradient inside the forward with an
incoming gradient of 1, so whatever multiplies the loss afterwards (engine.backward's 1 / accumulation steps, an fp16
loss scale, sequence.backward_factor) would reach the hidden states' gradient but not the head's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.model.gpt import soft_cap, token_loss_sum


def tiled_loss_sum(
    project: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    tiles: int,
    shared: bool = False,
) -> torch.Tensor:
    """Sum of the token losses (fp32, label -100 not counted) of project(hidden), ``tiles`` sequence tiles at a time.

    ``project``: the head (``lm_head``, a module, so that ZeRO-3 gathers its weight for each tile); ``weight``: its
    weight; ``shared``: the weight is also used before the head (tied to the embedding), so ZeRO must reduce its
    gradient once the embedding's share is in, not after the last tile."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def loss_sum(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(project(hidden), labels)

    compute_params = [weight]  # ZeRO: the head's gradient is ready after the last tile only
    if shared and torch.is_grad_enabled() and hidden.requires_grad:
        _hold_reduction_past_the_head(weight, hidden)
        compute_params = []
    return sequence_tiled_compute(
        loss_sum,
        hidden.shape[1],
        tiles,
        {"hidden": hidden, "labels": labels},
        {},
        "hidden",
        compute_params=compute_params,
        output_unshard_dimension=0,
        output_reduction="sum",
    )


def _hold_reduction_past_the_head(weight: torch.Tensor, hidden: torch.Tensor) -> None:
    """The one place dstrain works around DeepSpeed 0.19.8's tiled compute with a tied head (no upstream issue found;
    tests/test_memory_levers.py::test_deepspeed_tiled_compute_reduces_a_tied_head_twice fails when it is fixed).

    ZeRO reduces a parameter's gradient each time autograd accumulates one unless ``ds_grad_is_ready`` is False
    (DeepSpeed's convention for tiled compute). SequenceTiledCompute sets it True for the last tile, so ZeRO-2 reduces
    the head's share there and asserts when the embedding, the same weight, adds its share later ("has already been
    reduced"; ZeRO-3 asserts on the duplicate in its bucket). Here the reduction waits until the hidden states'
    gradient (the tiled loss's whole backward) is done; the embedding's accumulation then reduces the sum once."""
    weight.ds_grad_is_ready = False  # type: ignore[attr-defined]

    def release(grad: torch.Tensor) -> None:
        weight.ds_grad_is_ready = True  # type: ignore[attr-defined]

    hidden.register_hook(release)


def mean_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    tiles: int,
    shared: bool = False,
) -> torch.Tensor:
    """lm_loss of project(hidden) without its full logits: the tiled sum over the counted tokens."""
    losses = tiled_loss_sum(project, weight, hidden, labels, tiles, shared)
    return losses / (labels != -100).sum().clamp(min=1).to(losses.dtype)


def pipeline_loss(
    tiles: int, shared: bool, logit_softcap: float | None
) -> Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The pipeline's last-stage loss sum when its head layer hands over (hidden, weight) (dstrain.model.pipe), tile
    by tile, the logits soft-capped as model.logit_softcap says. ``shared``: the stage's head weight is also its
    embedding's (a tied head where one rank holds both ends, DualPipeV's rank 0); under 1F1B the last stage holds its
    own copy, whose gradient DeepSpeed adds to the embedding's after the backward."""

    def loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        hidden, weight = outputs

        def project(tile: torch.Tensor) -> torch.Tensor:
            return soft_cap(F.linear(tile, weight), logit_softcap)

        return tiled_loss_sum(project, weight, hidden, labels, tiles, shared)

    return loss


def tile_mlps(model: nn.Module, tiles: int) -> None:
    """Every block's MLP runs ``tiles`` sequence tiles at a time (DeepSpeed's TiledMLP), its parameters unchanged."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    for block in blocks:
        mlp: nn.Module = block.mlp  # type: ignore[assignment]
        params = list(mlp.parameters())

        def forward(x: torch.Tensor, mlp=mlp, plain=mlp.forward, params=params) -> torch.Tensor:
            return TiledMLP.apply(lambda _, tile: plain(tile), mlp, x, tiles, params)

        mlp.forward = forward  # an instance attribute: the module, its hooks and its parameter names stay
