"""DeepSpeed-Ulysses sequence parallelism (ds_config ``sequence_parallel_size``), applied from outside the model.

Each rank of a sequence-parallel (SP) group holds one contiguous slice of every sample: the dataset's labels are
already shifted (labels[t] = input_ids[t + 1]), so slicing after the shift loses no target at a slice boundary, and
each slice keeps the position ids of the full sequence (RoPE, gpt2's position table, document starts).

Everything but attention is per token. Attention runs through DeepSpeed's ``DistributedAttention``: an all-to-all
turns (B, L/sp, heads, d) into (B, L, heads/sp, d), the model's own ``CoreAttention`` attends over the whole
sequence for its heads, and a second all-to-all turns the result back. The core gets the full sequence's position
ids (all-gathered once per forward) for the document mask.

SP beyond the key/value heads (Arctic Long Sequence Training's rule): SP must divide the query heads only. Where it
does not divide the key/value heads, each rank repeats its slice's key/value heads (``kv_replicas``) before the
all-to-all, so that every rank receives the key/value heads its query heads read; the backward of the repeat sums
the replicas' gradients, which is the grouped-query gradient exactly (the same sum the core forms when it repeats
the heads itself, in another order).

The loss of a slice is its share of the sample's mean: sum of its tokens' losses / the tokens of the whole SP group
(dstrain.train.step.forward.ModelForward._forward_loss).
The shares add up to the full-sequence mean, and the gradient of the mean is the SUM over the SP group of each
rank's gradient, which is what DeepSpeed's reduction over its sequence-data-parallel group forms (it divides by the
data-parallel size only) under ZeRO 0, 1 and 2. See ``backward_factor`` for ZeRO-3.
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.model.config import GPTConfig
from dstrain.strategy.parallel import kv_replicas


def init_groups(sp_size: int):
    """DeepSpeed's SP process groups (consecutive ranks form an SP group; the replicas are the data-parallel
    dimension), returned as the ``mpu`` for deepspeed.initialize, as Arctic Long Sequence Training does.

    DeepSpeed's other route, a (data, sequence) device mesh built from the ds_config's ``data_parallel_size``,
    reduces gradients over the data-parallel group only in DeepSpeed 0.19.8
    (``groups._get_sequence_data_parallel_group`` falls back to the mesh's data_parallel dimension), so the SP ranks'
    gradients would never be combined."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._release_sequence_parallel_groups()  # a previous run in this process left its groups
    parallel_state_sp.initialize_sequence_parallel(sp_size)
    return parallel_state_sp


class FullPositions:
    """The full sequence's position ids from each rank's slice: one all-gather per forward, shared by the blocks
    (remembered by the identity of the slice, which every block receives as the same tensor)."""

    def __init__(self, group) -> None:
        self.group = group
        self._local: torch.Tensor | None = None
        self._full: torch.Tensor | None = None

    def __call__(self, position_ids: torch.Tensor) -> torch.Tensor:
        if position_ids is not self._local:
            parts = [torch.empty_like(position_ids) for _ in range(torch.distributed.get_world_size(self.group))]
            torch.distributed.all_gather(parts, position_ids.contiguous(), group=self.group)
            self._local, self._full = position_ids, torch.cat(parts, dim=1)
        assert self._full is not None
        return self._full


class UlyssesAttention(nn.Module):
    """``CoreAttention`` over the whole sequence for heads/sp heads, between two all-to-alls (DeepSpeed's
    DistributedAttention). No parameters: the model's state dict is the same with and without it."""

    def __init__(self, core: nn.Module, group, positions: FullPositions) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        super().__init__()
        # (B, L, heads, d): scatter the heads (dim 2), gather the sequence (dim 1).
        self.exchange = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)
        self.config: GPTConfig = core.config  # type: ignore[assignment]
        self.positions = positions
        self.replicas = kv_replicas(self.config.n_head, self.config.kv_heads, torch.distributed.get_world_size(group))

    def forward(self, q, k, v, position_ids):
        # Without doc masking the core attends causally over the gathered sequence, which is in order.
        full = self.positions(position_ids) if self.config.doc_masking and position_ids is not None else None
        if self.replicas > 1:
            k, v = k.repeat_interleave(self.replicas, dim=2), v.repeat_interleave(self.replicas, dim=2)
        return self.exchange(q, k, v, 0, None, full)


def apply(model: nn.Module, group) -> None:
    """Wrap every block's core attention."""
    positions = FullPositions(group)
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    for block in blocks:
        attention: nn.Module = block.self_attn  # type: ignore[assignment]
        attention.core = UlyssesAttention(attention.core, group, positions)  # type: ignore[arg-type]


def shard(batch: dict, sp_rank: int, sp_size: int, doc_masking: bool) -> dict:
    """This rank's contiguous slice of every sample's tokens. position_ids are the full sequence's: the dataset's
    (document starts) with doc masking, else 0..L-1, which is what the model assumes when it is given none."""
    length = batch["input_ids"].shape[1]
    part = length // sp_size
    window = slice(sp_rank * part, (sp_rank + 1) * part)
    positions = batch["position_ids"] if doc_masking else torch.arange(length, device=batch["input_ids"].device)
    positions = positions.expand_as(batch["input_ids"]) if positions.dim() == 1 else positions
    part = {
        "input_ids": batch["input_ids"][:, window].contiguous(),
        "labels": batch["labels"][:, window].contiguous(),
        "position_ids": positions[:, window].contiguous(),
    }
    if "documents" in batch:  # pairs: each label's piece (dstrain.data.pair_packing)
        part["documents"] = batch["documents"][:, window].contiguous()
    return part


def backward_factor(zero_stage: int, sp_size: int) -> float:
    """What the loss share is multiplied by before engine.backward, so that every ZeRO stage forms the gradient of
    the mean: the SUM over the SP group of the ranks' gradients, the mean over the data-parallel replicas.

    DeepSpeed 0.19.8 defect: ZeRO-3's reduce-scatter path (stage3.py ``__avg_scatter_grads``, taken whenever
    ``zero_optimization.reduce_scatter`` is on, its default) averages over the whole sequence-data-parallel group
    with ``reduce_scatter_coalesced``, ignoring ``sequence_parallel_size`` that its other path and ZeRO 0/1/2 divide
    out, so the gradient comes out sp_size times too small (Adam nearly hides it; clipping and the logged norm do
    not). parallel.check_sequence_parallel refuses reduce_scatter off, so ZeRO-3 always takes that path.
    tests/test_sequence.py::test_deepspeed_zero3_averages_over_the_sp_group fails when it is fixed upstream."""
    return float(sp_size) if zero_stage == 3 and sp_size > 1 else 1.0
