"""The RL objective's optimizer steps on one rollout: ``cfg.iterations`` steps on the same samples (the first with the
policy's own log-probs as the old ones, ratio 1; the later ones against the first's, clipped), each over this rank's
share of the completions micro-batch by micro-batch through the DeepSpeed engine.

Each micro-batch's loss is its share of the step's loss (dstrain.train.objectives.online_rl.losses: token weights
from the whole step's counts) times dp x accumulation, since DeepSpeed's backward divides by the accumulation steps
and its all-reduce averages over the data-parallel ranks: the gradient formed is the step's loss's, whatever the
split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dstrain.train.objectives.online_rl.losses import token_loss, token_weights
from dstrain.train.objectives.online_rl.rollout import Rollout


@dataclass
class StepResult:
    loss: float  # the step's loss, over all ranks
    grad_norm: float | None  # before clipping (DeepSpeed's global norm)
    sums: dict  # token-weighted sums of entropy, kl, clip ratios and their token count, over all ranks


def completion_logps(engine, prompt_ids: list[list[int]], tokens: torch.Tensor, mask: torch.Tensor, temperature: float):
    """(log-probs (B, T) of the completion tokens under softmax(logits / temperature), entropies (B, T)) from one
    forward of each prompt + completion, right-padded (padding after a row changes none of its logits)."""
    rows = [p + tokens[b][mask[b]].tolist() for b, p in enumerate(prompt_ids)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    logits = engine(ids.to(tokens.device))
    starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=tokens.device)
    at = (starts[:, None] + torch.arange(tokens.shape[1], device=tokens.device)).clamp(max=width - 1)
    picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])).float() / temperature
    logprobs = F.log_softmax(picked, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, tokens[..., None]).squeeze(-1), entropy


class RLStep:
    """The optimizer steps of each rollout (module doc); ``reference``: a plain GPT of init_from's weights (beta >
    0)."""

    def __init__(self, engine, cfg, micro_batch: int, grad_accum: int, dp_size: int, reference=None) -> None:
        self.engine, self.cfg, self.reference = engine, cfg, reference
        self.micro_batch, self.grad_accum, self.dp_size = micro_batch, grad_accum, dp_size
        self.old: list[torch.Tensor] = []  # the first iteration's log-probs per micro-batch

    def steps(self, rollout: Rollout) -> list[StepResult]:
        self.old = []
        return [self.step(rollout, iteration) for iteration in range(self.cfg.iterations)]

    def step(self, rollout: Rollout, iteration: int) -> StepResult:
        device = rollout.decoded.tokens.device
        sums = torch.zeros(6, dtype=torch.float64, device=device)  # loss, entropy, kl, low, high, tokens
        for micro in range(self.grad_accum):
            rows = slice(micro * self.micro_batch, (micro + 1) * self.micro_batch)
            loss, micro_sums = self._micro_batch(rollout, rows, micro, iteration)
            self.engine.backward(loss * (self.dp_size * self.grad_accum))
            self.engine.step()
            sums += micro_sums
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        grad_norm = self.engine.get_global_grad_norm()
        named = dict(zip(("entropy", "kl", "clip_low", "clip_high", "tokens"), sums[1:].tolist()))
        return StepResult(sums[0].item(), None if grad_norm is None else float(grad_norm), named)

    def _micro_batch(self, rollout: Rollout, rows: slice, micro: int, iteration: int):
        out, cfg = rollout.decoded, self.cfg
        tokens, mask = out.tokens[rows], out.mask[rows]
        prompt_ids = rollout.prompt_ids[rows]
        logps, entropy = completion_logps(self.engine, prompt_ids, tokens, mask, cfg.temperature)
        if iteration == 0:
            self.old.append(logps.detach())
        ref = None
        if cfg.beta != 0.0:
            with torch.no_grad():
                ref = completion_logps(self.reference, prompt_ids, tokens, mask, cfg.temperature)[0]
        old = None if iteration == 0 else self.old[micro]
        terms = token_loss(logps, old, rollout.advantages[rows], cfg.epsilon, cfg.clip_high, cfg.beta, ref)
        weights = token_weights(mask, cfg.loss_type, rollout.counts)
        loss = (terms.loss * weights).sum()
        m = mask.double()
        kl = (terms.kl.detach().double() * m).sum() if terms.kl is not None else torch.zeros((), device=m.device)
        sums = torch.stack([loss.detach().double(), (entropy.detach().double() * m).sum(), kl,
                            (terms.low_clipped * m).sum(), (terms.high_clipped * m).sum(), m.sum()])  # fmt: skip
        return loss, sums
