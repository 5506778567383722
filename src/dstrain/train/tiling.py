"""Sequence tiling (ds_config ``"tiling": {"loss": n, "mlp": m}``): memory, not math.

The loss is computed n sequence tiles at a time, so the (tokens x vocabulary) logits, their fp32 log-probabilities
and their gradient exist for one tile only; each MLP runs m tiles at a time, so its (tokens x d_ff) intermediates do.
Both recompute their tile in the backward (DeepSpeed's SequenceTiledCompute and TiledMLP, from Arctic Long Sequence
Training). DeepSpeed's TiledFusedLogitsLoss is not used: it computes the head's gradient inside the forward with an
incoming gradient of 1, so whatever multiplies the loss afterwards (engine.backward's 1 / accumulation steps, an fp16
loss scale, sequence.backward_factor) would reach the hidden states' gradient but not the head's.
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.model.gpt import token_loss_sum


def tiled_loss_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, tiles: int) -> torch.Tensor:
    """Sum of the token losses (fp32, label -100 not counted) of lm_head(hidden), ``tiles`` sequence tiles at a time."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def loss_sum(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(lm_head(hidden), labels)

    return sequence_tiled_compute(
        loss_sum,
        hidden.shape[1],
        tiles,
        {"hidden": hidden, "labels": labels},
        {},
        "hidden",
        compute_params=[lm_head.weight],  # ZeRO: the head's gradient is ready after the last tile only
        output_unshard_dimension=0,
        output_reduction="sum",
    )


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
