"""Sequence tiling (ds_config ``"tiling": {"loss": n, "mlp": m}``): memory, not math.

The loss is computed n chunks of the tokens at a time, so the (tokens x vocabulary) logits, their fp32 scores and
their gradient exist for one chunk only, and the head's gradients are formed in the same pass (fused linear
cross-entropy, dstrain.model.chunked_loss): nothing is recomputed, the head's matmuls run once as for the whole loss.
Each MLP runs m tiles at a time, so its (tokens x d_ff) intermediates do; it recomputes its tile in the backward
(DeepSpeed's TiledMLP, from Arctic Long Sequence Training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dstrain.model.chunked_loss import chunked_loss_sum


def tiled_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, tiles: int) -> torch.Tensor:
    """Sum of the token losses (fp32, label -100 not counted) of head(hidden), ``tiles`` chunks at a time.

    ``head``: the model's lm_head (model.gpt.Head), called as a module so that ZeRO-3 gathers its weight around the
    loss; a tied head's gradient reaches the embedding's weight through autograd, summed before ZeRO reduces it."""
    return head(hidden, labels, tiles)


def mean_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, tiles: int) -> torch.Tensor:
    """lm_loss of head(hidden) without its full logits: the chunked sum over the counted tokens."""
    losses = tiled_loss_sum(head, hidden, labels, tiles)
    return losses / (labels != -100).sum().clamp(min=1).to(losses.dtype)


def pipeline_loss(
    tiles: int, logit_softcap: float | None
) -> Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The pipeline's last-stage loss sum when its head layer hands over (hidden, weight) (dstrain.model.pipe), chunk
    by chunk, the logits soft-capped as model.logit_softcap says. A tied head's weight is the stage's copy of the
    embedding's (1F1B: DeepSpeed adds its gradient to the embedding's after the backward) or the embedding itself
    (DualPipeV's rank 0 holds both ends); either way its gradient is an ordinary autograd one."""

    def loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        hidden, weight = outputs
        return chunked_loss_sum(hidden, weight, labels, tiles, logit_softcap)

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
