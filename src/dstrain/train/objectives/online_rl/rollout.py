"""One step's samples: each data-parallel rank decodes its share of the step's completions with the policy's own
weights (dstrain.model.generate), scores them with the reward functions, and every rank takes the advantages of its
share from the whole step's rewards (one all-gather of N floats per reward function).

Completion c of a step (0 <= c < prompts_per_step x group_size) is sample c % G of prompt c // G, drawn from the
generator seeded by (recipe seed, step, the prompt's dataset index, c % G): which rank decodes it, and next to which
other rows, changes nothing (invariant 14).

Layouts: under ZeRO-3 each rank gathers the whole model once per rollout (deepspeed.zero.GatheredParameters over
every parameter), never per token; ZeRO-0/1/2 hold it whole already. Pipeline stages, tensor, sequence and expert
parallelism are refused for an ``rl:`` recipe (dstrain.train.objectives.online_rl.checks): a decode there would need the
stages' or shards' collectives at every token.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dstrain.model.generate import Decoded, Sampling, decode, sample_seed
from dstrain.model.gpt import GPT
from dstrain.objectives.rl_rewards import Reward, score
from dstrain.train.objectives.online_rl.losses import StepCounts, group_advantages


@dataclass(frozen=True)
class Prompt:
    index: int  # the row of the prompts dataset
    ids: list[int]  # the prompt's tokens (rendered by the chat template for a conversation)
    prompt: object  # what reward functions get as the prompt: the text, or the conversation
    columns: dict = field(default_factory=dict)  # the dataset's other columns that reward functions read


@dataclass
class Rollout:
    """This rank's share of a step's completions, and what the loss and the metrics need of the whole step."""

    prompt_ids: list[list[int]]  # per completion of the share
    decoded: Decoded
    advantages: torch.Tensor  # (n,) this share's
    counts: StepCounts
    rewards: torch.Tensor  # (N, functions) the whole step's
    weighted: torch.Tensor  # (N,) the whole step's rewards
    zero_spread: torch.Tensor  # (prompts,) bool: the groups whose rewards are all equal
    lengths: torch.Tensor  # (N,) the whole step's completion lengths
    stopped: torch.Tensor  # (N,) bool: ended by a stop token (else truncated)
    seconds: float  # this rank's decode and scoring time


def share(completions: int, dp_size: int, dp_rank: int) -> range:
    """The completions data-parallel rank ``dp_rank`` decodes and trains on: a contiguous slice."""
    per_rank = completions // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def gathered(module: torch.nn.Module, zero_stage: int):
    """Under ZeRO-3 the whole model on this rank for the block (one gather for a whole rollout); else nothing."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def rollout(
    module: GPT,
    prompts: list[Prompt],
    cfg,
    seed: int,
    step: int,
    rewards: list[Reward],
    detokenize: Callable[[list[int]], str],
    stop_ids: list[int],
    pad_id: int,
    zero_stage: int,
    dp_rank: int,
    dp_size: int,
) -> Rollout:
    """``cfg``: the recipe's RLConfig; ``prompts``: the step's, in order; ``module``: the engine's plain GPT."""
    start = time.perf_counter()
    group = cfg.group_size
    mine = share(len(prompts) * group, dp_size, dp_rank)
    rows = [(prompts[c // group], c % group) for c in mine]
    seeds = [sample_seed(seed, step, p.index, s) for p, s in rows]
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    was_training = module.training
    module.eval()
    try:
        with gathered(module, zero_stage):
            out = decode(module, [p.ids for p, _ in rows], sampling, stop_ids, pad_id, seeds)
    finally:
        module.train(was_training)
    completion_ids = [out.completion(r) for r in range(len(rows))]
    columns = {name: [p.columns[name] for p, _ in rows] for name in (rows[0][0].columns if rows else {})}
    local = score(rewards, [p.prompt for p, _ in rows], [detokenize(ids) for ids in completion_ids],
                  completion_ids, columns, [p.index for p, _ in rows])  # fmt: skip
    device = out.tokens.device
    local_stats = torch.cat([torch.tensor(local, dtype=torch.float64, device=device).T.reshape(len(rows), -1),
                             torch.stack([out.mask.sum(1), out.stopped]).T.double()], dim=1)  # fmt: skip
    whole = _all_gather(local_stats, dp_size)
    functions = len(rewards)
    per_function = whole[:, :functions]
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float64, device=device)
    weighted = (per_function * weights).sum(1)
    advantages, zero_spread = group_advantages(weighted, group, cfg.scale_rewards)
    lengths = whole[:, functions]
    counts = StepCounts(len(prompts) * group, int(lengths.sum().item()), cfg.max_new_tokens)
    return Rollout(
        prompt_ids=[p.ids for p, _ in rows], decoded=out, advantages=advantages[mine.start : mine.stop].float(),
        counts=counts, rewards=per_function, weighted=weighted, zero_spread=zero_spread, lengths=lengths,
        stopped=whole[:, functions + 1] > 0, seconds=time.perf_counter() - start,
    )  # fmt: skip


def _all_gather(local: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Every data-parallel rank's rows, in rank order (the ranks of one replica hold the same rows: none here, as
    tensor/sequence/pipeline layouts are refused, so the data-parallel group is the world)."""
    if dp_size == 1 or not torch.distributed.is_initialized():
        return local
    parts = [torch.empty_like(local) for _ in range(dp_size)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def to_state(index: int, out: Rollout, old: list[torch.Tensor], world: int) -> dict:
    """A rollout and its first iteration's log-probs as plain tensors and numbers, for a checkpoint's rank file (a
    resume inside a rollout trains on the same samples against the same old log-probs)."""
    d = out.decoded
    tensors = {"tokens": d.tokens, "mask": d.mask, "logprobs": d.logprobs, "row_stopped": d.stopped,
               "advantages": out.advantages, "rewards": out.rewards, "weighted": out.weighted,
               "zero_spread": out.zero_spread, "lengths": out.lengths, "stopped": out.stopped}  # fmt: skip
    counts = [out.counts.completions, out.counts.tokens, out.counts.max_new_tokens]
    return {"index": index, "world": world, "prompt_ids": out.prompt_ids, "counts": counts, "seconds": out.seconds,
            "old": [o.cpu() for o in old], **{k: v.cpu() for k, v in tensors.items()}}  # fmt: skip


def from_state(state: dict, device: torch.device) -> tuple[int, Rollout, list[torch.Tensor]]:
    """(rollout index, rollout, old log-probs) of ``to_state``'s dict, on ``device``."""
    on = {k: v.to(device) for k, v in state.items() if isinstance(v, torch.Tensor)}
    decoded = Decoded(on["tokens"], on["mask"], on["logprobs"], on["row_stopped"])
    out = Rollout(
        prompt_ids=state["prompt_ids"], decoded=decoded, advantages=on["advantages"],
        counts=StepCounts(*state["counts"]), rewards=on["rewards"], weighted=on["weighted"],
        zero_spread=on["zero_spread"], lengths=on["lengths"], stopped=on["stopped"], seconds=state["seconds"],
    )  # fmt: skip
    return state["index"], out, [o.to(device) for o in state["old"]]
