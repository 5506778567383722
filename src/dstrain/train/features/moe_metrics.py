"""The router losses a step adds to the LM loss, and what metrics.jsonl records about the experts.

Per log interval: moe_aux_loss and moe_z_loss (means over micro-batches, ranks and MoE layers, before their
coefficients), and per MoE layer i the share of routed tokens each expert received: moe_layer<i>_share_min,
_share_max and _share_entropy (nats; ln(num_experts) is perfectly balanced); with sigmoid scoring (DeepSeek-V3) the
spread of its balancing bias, moe_layer<i>_bias_min and _bias_max (train/features/balancing.py moves it). Dispatch is
dropless: no token is ever dropped, so there is no dropped-token count.
"""

from __future__ import annotations

import math

import torch

from dstrain.model.config import GPTConfig
from dstrain.model.moe import moe_routers, router_losses
from dstrain.train.step.components import Component, Progress
from dstrain.train.step.handle import RunHandle


def build(run: RunHandle) -> MoEMeter | None:
    """The meter of a model with MoE blocks; None for a dense one."""
    meter = MoEMeter(run.engine.module, run.recipe.model, run.device)
    return meter if meter.enabled else None


class MoEMeter(Component):
    def __init__(self, module: torch.nn.Module, config: GPTConfig, device) -> None:
        self.module, self.config, self.device = module, config, device
        self.routers = moe_routers(module)
        self.layers = [i for i in range(config.n_layer) if config.is_moe_block(i)]
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # aux, z, micro-batches
        # Routed tokens per expert of each MoE layer since the last record
        self.counts = [torch.zeros(r.num_experts, dtype=torch.float64, device=device) for r in self.routers]

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """The LM loss plus the router losses (aux and z, their coefficients applied)."""
        return loss + self.losses() if self.enabled else loss

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return self.record() if self.enabled else {}

    def losses(self) -> torch.Tensor:
        """What the last forward's routers add to the LM loss (coefficients applied); counted for the metrics."""
        extra, aux, z = router_losses(self.module, self.config)
        self.sums += torch.stack([aux.detach().double(), z.detach().double(), torch.ones((), dtype=torch.float64)])
        # Counted here, once per micro-batch: a checkpointed block's recompute runs its router again (model/moe.py).
        for router, counts in zip(self.routers, self.counts):
            if router.counts is not None:
                counts += router.counts.to(counts.device)
        return extra

    def record(self) -> dict:
        """A collective: the interval's aux/z means over all ranks and the token shares per layer; then reset."""
        packed = torch.cat([self.sums, *self.counts])
        torch.distributed.all_reduce(packed)
        self.sums.zero_()
        for counts in self.counts:
            counts.zero_()
        aux, z, n = packed[:3].tolist()
        record: dict = {"moe_aux_loss": aux / max(n, 1), "moe_z_loss": z / max(n, 1)}
        offset = 3
        for layer, router in zip(self.layers, self.routers):
            share = packed[offset : offset + router.num_experts]
            offset += router.num_experts
            share = share / share.sum().clamp(min=1)
            entropy = -sum(p * math.log(p) for p in share.tolist() if p > 0)
            # Flat scalars, which DeepSpeed's monitors (TensorBoard, CSV, W&B) also receive.
            record[f"moe_layer{layer}_share_min"] = share.min().item()
            record[f"moe_layer{layer}_share_max"] = share.max().item()
            record[f"moe_layer{layer}_share_entropy"] = entropy
            bias = router.e_score_correction_bias
            if bias is not None:  # the same on every rank: no collective
                record[f"moe_layer{layer}_bias_min"], record[f"moe_layer{layer}_bias_max"] = (
                    bias.min().item(),
                    bias.max().item(),
                )
        return record
