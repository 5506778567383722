"""Decoding with our own model and its KV cache (model/kv_cache.py): prefill the left-padded prompts in one forward,
then one token per row per forward, until every row has emitted a stop token or ``max_new_tokens``.

Sampling is seeded per row: each row draws its uniforms from a CPU torch.Generator of its own, seeded by the caller
(``sample_seed``: the run's seed, the step, the prompt's index and the sample's index), and picks its token by
inverting the CDF of its (temperature-scaled, top-k/top-p filtered) distribution. A row's tokens so depend on its
prompt, its seed and the weights only: not on the other rows, the batch split or the device count.

The log-probability kept for each token is that of the temperature-scaled distribution before top-k/top-p, the one
the trainer computes from the same logits (``token_logprobs``; greedy decoding keeps temperature 1's).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dstrain.errors import DstrainError
from dstrain.model.kv_cache import KVCache, left_padded, positions

if TYPE_CHECKING:
    from dstrain.model.gpt import GPT


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen."""

    max_new_tokens: int  # the most tokens a completion gets; a row that reaches it is truncated
    temperature: float = 1.0  # logits divided by it; 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p; 1 = all

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution whose log-probs the decode keeps and the trainer recomputes."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Decoded:
    """The completions of a decode, one row per prompt: tokens (B, T) (``pad_id`` past a row's end), ``mask`` (B, T)
    the row's own tokens (its stop token included), ``logprobs`` (B, T) fp32, ``stopped`` (B,) whether the row emitted a
    stop token (else it was truncated at max_new_tokens)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    stopped: torch.Tensor

    def completion(self, row: int) -> list[int]:
        return self.tokens[row][self.mask[row]].tolist()


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample's generator: a hash, so that neighbouring indices give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits (B, V) in fp32 over the temperature, the tokens top-k and top-p drop at -inf (transformers' order:
    temperature, top-k, top-p; top-p keeps at least one token)."""
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1)  # ascending, as transformers' TopPLogitsWarper
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def pick(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """The next token of each row (B,): argmax at temperature 0, else the inverse CDF at the row's own uniform."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = filtered_logits(logits.float(), sampling).softmax(-1).double()
    uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = probs.cumsum(-1)
    threshold = uniforms.to(logits.device)[:, None] * cdf[:, -1:]
    return (cdf < threshold).sum(-1).clamp(max=logits.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), in fp32: what decode keeps and what the trainer computes."""
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def decode(
    model: GPT,
    prompts: list[list[int]],
    sampling: Sampling,
    stop_ids: list[int],
    pad_id: int,
    seeds: list[int] | None = None,
) -> Decoded:
    """The completions of ``prompts`` (token lists, any lengths, none empty) by the plain GPT ``model`` (its weights
    whole on this rank: under ZeRO-3 the caller gathers them, once); ``seeds``: one per prompt (sampling only)."""
    config = model.config
    if any(not p for p in prompts):
        raise DstrainError("decode: an empty prompt; every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    if config.position_limit and longest + sampling.max_new_tokens > config.position_limit:
        raise DstrainError(
            f"a prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds the model's "
            f"{config.position_limit} positions; shorten the prompts or lower max_new_tokens"
        )
    if sampling.temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise DstrainError("decode: sampling needs one seed per prompt")
    weight = model.embed.tok.weight
    ids, real = left_padded(prompts, pad_id, weight.device)
    batch, steps = len(prompts), sampling.max_new_tokens
    cache = KVCache(config, batch, ids.shape[1] + steps, weight.dtype, weight.device)
    generators = [torch.Generator().manual_seed(s) for s in seeds or []]
    tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=weight.device)
    mask = torch.zeros(batch, steps, dtype=torch.bool, device=weight.device)
    logprobs = torch.zeros(batch, steps, dtype=torch.float32, device=weight.device)
    done = torch.zeros(batch, dtype=torch.bool, device=weight.device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=weight.device)
    position = positions(real)
    cache.begin(real)
    logits = model.lm_head(model(ids, position, head=False, cache=cache)[:, -1])  # the last column's logits only
    position = position[:, -1:]
    used = 0
    for t in range(steps):
        token = pick(logits, sampling, generators)
        tokens[:, t] = torch.where(done, pad_id, token)
        mask[:, t] = ~done
        logprobs[:, t] = torch.where(done, 0.0, token_logprobs(logits, token, sampling.logprob_temperature))
        done |= torch.isin(token, stops) & mask[:, t]
        used = t + 1
        if bool(done.all()) or t == steps - 1:
            break
        position = position + 1
        cache.begin(torch.ones(batch, 1, dtype=torch.bool, device=weight.device))
        logits = model.lm_head(model(tokens[:, t : t + 1], position, head=False, cache=cache)[:, -1])
    return Decoded(tokens[:, :used], mask[:, :used], logprobs[:, :used], done)
