"""DeepSeek-V3's auxiliary-loss-free load balancing (DeepSeek-V3 technical report, section 2.1.2) as a training rule.

Each sigmoid-scored router (model.moe.scoring sigmoid, model/moe.py) adds a per-expert bias to its scores when it
chooses experts (never to the weights). After each optimizer step every expert's bias moves by the fixed rate
model.moe.bias_update_rate: down where the expert received more than the mean load of its layer in that step, up where
it received less (b_i += rate * sign(mean load - load_i)). The load is the step's routed tokens per expert over every
micro-batch and every rank (one all-reduce), so the rule is the same under any data or expert-parallel layout.

The bias is the router's buffer e_score_correction_bias (in the model's state dict: checkpoints and export carry it,
as transformers' DeepseekV3 does). This component keeps an fp32 copy that it updates and writes into the buffer, so a
bf16 engine's rounding of buffers never accumulates into the bias; the copy is part of the checkpoint's client state.
MoE with pipeline stages, tensor or sequence parallelism is refused (strategy/parallel.py), so every rank holds every
router and the counts have the same shape on every rank.
"""

from __future__ import annotations

import torch

from dstrain.model.config import GPTConfig
from dstrain.model.moe import Router, moe_routers
from dstrain.train.step.components import Component, StepOutcome, Verdict
from dstrain.train.step.handle import RunHandle


def bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """The bias after one step of DeepSeek-V3's rule: each expert's moves by ``rate`` toward the mean load."""
    return bias + rate * torch.sign(load.mean() - load)


def _bias(router: Router) -> torch.Tensor:
    assert router.e_score_correction_bias is not None  # the routers this component holds: sigmoid scoring
    return router.e_score_correction_bias


def build(run: RunHandle) -> LossFreeBalancing | None:
    """The rule of a model whose routers carry a balancing bias moved at a positive rate; None otherwise."""
    balancing = LossFreeBalancing(run.engine.module, run.recipe.model, run.device)
    return balancing if balancing.enabled else None


class LossFreeBalancing(Component):
    state_key = "loss_free_balancing"

    def __init__(self, module: torch.nn.Module, config: GPTConfig, device) -> None:
        self.rate = config.moe.bias_update_rate if config.moe is not None else 0.0
        self.routers = [r for r in moe_routers(module) if r.e_score_correction_bias is not None]
        self.loads = torch.zeros(len(self.routers), max((r.num_experts for r in self.routers), default=0))
        self.loads = self.loads.to(device=device, dtype=torch.float64)
        self.biases: list[torch.Tensor] = []
        self.loaded = False  # the biases came from the checkpoint's client state

    @property
    def enabled(self) -> bool:
        return bool(self.routers) and self.rate > 0

    def on_train_start(self) -> None:
        """The fp32 copies start from the buffers as loaded (init_from, a checkpoint), or from the client state."""
        if not self.loaded:
            self.biases = [_bias(r).detach().float().clone() for r in self.routers]

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "step":  # a step undone by a rollback left its loads here
            self.loads.zero_()

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """Counts this micro-batch's routed tokens (the routers' last training forward); the loss is unchanged."""
        for row, router in zip(self.loads, self.routers, strict=True):
            if router.counts is not None:
                row[: router.num_experts] += router.counts.to(row.device)
        return loss

    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        if not self.enabled:
            return Verdict.GO_ON
        torch.distributed.all_reduce(self.loads)
        for i, router in enumerate(self.routers):
            load = self.loads[i, : router.num_experts].to(self.biases[i].device, torch.float32)
            self.biases[i] = bias_step(self.biases[i], load, self.rate)
            with torch.no_grad():
                _bias(router).copy_(self.biases[i])
        self.loads.zero_()
        return Verdict.GO_ON

    def state_dict(self) -> dict | None:
        return {"biases": [b.cpu() for b in self.biases]} if self.enabled else None

    def load_state_dict(self, state: dict | None) -> None:
        if state is None or not self.enabled:  # a run that saved none: the biases are the model's buffers
            return
        self.biases = [b.to(_bias(r).device) for b, r in zip(state["biases"], self.routers)]
        self.loaded = True
        for bias, router in zip(self.biases, self.routers, strict=True):
            with torch.no_grad():
                _bias(router).copy_(bias)
