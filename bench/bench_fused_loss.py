"""The chunked loss at no extra cost: one training step's time and peak tensor memory with the loss chunked (the
head's gradients formed in its forward, dstrain.model.chunked_loss) against the whole loss, side by side in one
run, at Qwen2.5's 151,936-entry vocabulary on this CPU. fp32; each step is a fresh seeded model's forward and
backward (a 2-block llama, d_model 128, untied head), timed as the median of ``--repeats`` alternating runs; the
memory is torch's memory profiler's peak of tensors allocated during the step (dstrain.metrics.peak_tensor_bytes),
measured in a run of its own. The chunked run's loss and gradients are checked against the whole one's.

    python bench/bench_fused_loss.py [--seq 1024] [--batch 2] [--chunks 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dstrain.metrics import peak_tensor_bytes
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT, token_loss_sum
from dstrain.train.engine import tiling

MIB = 2**20
VOCAB = 151_936  # Qwen2.5's


def model(seq: int) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        flavour="llama", vocab_size=VOCAB, max_seq_len=seq, n_layer=2, n_head=4, n_kv_head=2, d_model=128
    )
    return GPT(config)


def step(net: GPT, ids: torch.Tensor, chunks: int) -> torch.Tensor:
    """One forward and backward; the loss (mean over the tokens)."""
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if chunks > 1:
        loss = tiling.tiled_loss_sum(net.lm_head, net(inputs, head=False), labels, chunks) / labels.numel()
    else:
        loss = token_loss_sum(net(inputs), labels) / labels.numel()
    loss.backward()
    return loss.detach()


def timed(net: GPT, ids: torch.Tensor, chunks: int) -> float:
    net.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step(net, ids, chunks)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ids = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    nets = {1: model(args.seq), args.chunks: model(args.seq)}
    losses, grads = {}, {}
    for chunks, net in nets.items():  # the first step of each: the same math, and warm caches
        losses[chunks] = step(net, ids, chunks)
        grads[chunks] = [p.grad.clone() for p in net.parameters()]
    loss_diff = abs(losses[args.chunks] - losses[1]).item()
    grad_diff = max(((c - w).abs().max() / w.abs().max()).item() for c, w in zip(grads[args.chunks], grads[1]))
    seconds: dict[int, list[float]] = {1: [], args.chunks: []}
    for _ in range(args.repeats):  # alternating, so that a neighbour's load falls on both
        for chunks, net in nets.items():
            seconds[chunks].append(timed(net, ids, chunks))
    peaks = {}
    for chunks, net in nets.items():
        net.zero_grad(set_to_none=True)
        peaks[chunks] = peak_tensor_bytes(lambda net=net, chunks=chunks: step(net, ids, chunks), "cpu")
    whole_s, chunked_s = (statistics.median(seconds[c]) for c in (1, args.chunks))
    print(
        f"llama 2 x d_model 128, vocabulary {VOCAB:,} (untied), {args.batch} x {args.seq} tokens, fp32, "
        f"{torch.get_num_threads()} threads; median of {args.repeats}"
    )
    print("| loss | step s | peak tensor MiB |")
    print("|---|---|---|")
    print(f"| whole | {whole_s:.3f} | {peaks[1] / MIB:.0f} |")
    print(f"| {args.chunks} chunks (fused) | {chunked_s:.3f} | {peaks[args.chunks] / MIB:.0f} |")
    print(
        f"chunked / whole: time {chunked_s / whole_s:.2f}, memory {peaks[args.chunks] / peaks[1]:.3f}; "
        f"loss diff {loss_diff:.1e}, max grad diff (relative) {grad_diff:.1e}"
    )


if __name__ == "__main__":
    main()
