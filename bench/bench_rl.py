"""The RL objective's sampling, side by side in one run on this machine's accelerator (get_accelerator()):

- tokens generated per second by dstrain.model.generate's KV-cache decode, against decoding the same completions
  without a cache (each token one forward of the whole prefix, as a plain re-implementation would): the speed-up;
- the generation share of one RL step: the rollout's decode over the rollout plus the optimizer step on its samples
  (forward and backward of every completion, AdamW), the figure that says what to speed up next;
- with --check-cpu (a GPU run): the device's greedy completions against the CPU's, token for token (fp32).

    python bench/bench_rl.py                     # the tiny demo's model size (recipes/tiny.yaml), 32 x 64 tokens
    python bench/bench_rl.py --json out.json --check-cpu

Figures: BENCHMARKS.md (RL).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from deepspeed.accelerator import get_accelerator

from dstrain.model.config import GPTConfig
from dstrain.model.generate import Sampling, decode, sample_seed
from dstrain.model.gpt import GPT

TINY = dict(flavour="llama", n_layer=4, n_head=4, n_kv_head=2, d_model=128, vocab_size=4096, max_seq_len=512)


def synchronize() -> None:
    get_accelerator().synchronize()


def uncached(model: GPT, prompts: list[list[int]], new: int, generators: list[torch.Generator]) -> torch.Tensor:
    """The same sampling without a cache: every token one forward of each row's whole prefix (rows of equal length)."""
    ids = torch.tensor(prompts, device=model.embed.tok.weight.device)
    for _ in range(new):
        logits = model(ids)[:, -1].float()
        uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
        cdf = logits.softmax(-1).double().cumsum(-1)
        token = (cdf < uniforms.to(cdf.device)[:, None] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
        ids = torch.cat([ids, token[:, None]], dim=1)
    return ids[:, len(prompts[0]) :]


def timed(fn) -> tuple[float, object]:
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return time.perf_counter() - start, out


def train_step(model: GPT, optimizer, prompts: list[list[int]], completions: torch.Tensor) -> None:
    """One optimizer step on the samples: forward and backward of every prompt + completion (a stand-in loss of the
    completions' log-probs, the RL loss's cost)."""
    ids = torch.cat([torch.tensor(prompts, device=completions.device), completions], dim=1)
    logits = model(ids)[:, len(prompts[0]) - 1 : -1].float()
    loss = -torch.log_softmax(logits, -1).gather(-1, completions[..., None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 4096, (args.batch, args.prompt_tokens), generator=g).tolist()
    seeds = [sample_seed(0, 0, i, 0) for i in range(args.batch)]
    sampling = Sampling(args.new_tokens, temperature=1.0)
    model.eval()
    decode(model, prompts[:2], Sampling(4, 1.0), [], 0, seeds[:2])  # warm-up
    cached_s, out = timed(lambda: decode(model, prompts, sampling, [], 0, seeds))
    plain_s, plain = timed(
        lambda: uncached(model, prompts, args.new_tokens, [torch.Generator().manual_seed(s) for s in seeds])
    )
    with torch.no_grad():
        agree = (plain == out.tokens).float().mean().item()  # the same seeds: the same tokens (up to near ties)
    model.train()
    step_s, _ = timed(lambda: train_step(model, optimizer, prompts, out.tokens))
    tokens = args.batch * args.new_tokens
    return {
        "device": str(device),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "cached_tokens_per_s": tokens / cached_s,
        "uncached_tokens_per_s": tokens / plain_s,
        "kv_cache_speedup": plain_s / cached_s,
        "same_tokens_share": agree,
        "rollout_s": cached_s,
        "train_step_s": step_s,
        "generation_share": cached_s / (cached_s + step_s),
    }


def cpu_agreement(args: argparse.Namespace, device: torch.device) -> float:
    """Share of greedy completion tokens the device decodes as the CPU does (fp32, the same weights)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    prompts = torch.randint(2, 4096, (8, 17), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = Sampling(args.new_tokens, temperature=0)
    on_cpu = decode(model, prompts, greedy, [], 0).tokens
    on_device = decode(model.to(device), prompts, greedy, [], 0).tokens.cpu()
    return (on_cpu == on_device).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="completions decoded together (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--check-cpu", action="store_true", help="greedy completions on the device against the CPU's")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    device = torch.device(get_accelerator().device_name())
    figures = measure(args, device)
    if args.check_cpu:
        figures["greedy_same_as_cpu"] = cpu_agreement(args, device)
    for key, value in figures.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
