"""Peak tensor memory of one forward + backward of the tiny model at a long sequence, with and without sequence
tiling of the loss and of the MLPs (ds_config "tiling"), and the losses and gradients of each against the untiled
run. CPU, fp32, batch 1; the figure is the allocator's (torch's memory profiler), not the process's RSS.

    python bench/bench_tiling.py [--seq 8192] [--tiles 8]
"""

from __future__ import annotations

import argparse

import torch

from dstrain.metrics import peak_tensor_bytes
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT, token_loss_sum
from dstrain.train.engine import tiling

MIB = 2**20


def tiny(seq: int, flavour: str = "llama") -> GPTConfig:
    """recipes/tiny.yaml's model with the demo corpus's 4096-entry vocabulary, positions up to ``seq``."""
    kv = 2 if flavour == "llama" else None
    return GPTConfig(flavour=flavour, vocab_size=4096, max_seq_len=seq, n_layer=4, n_head=4, n_kv_head=kv, d_model=128)


def step(config: GPTConfig, ids: torch.Tensor, loss_tiles: int, mlp_tiles: int):
    """(loss, gradients, peak bytes) of one forward + backward."""
    torch.manual_seed(0)
    model = GPT(config)
    if mlp_tiles > 1:
        tiling.tile_mlps(model, mlp_tiles)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    result = {}

    def forward_backward():
        if loss_tiles > 1:
            loss = tiling.tiled_loss_sum(model.lm_head, model(inputs, head=False), labels, loss_tiles) / labels.numel()
        else:
            loss = token_loss_sum(model(inputs), labels) / labels.numel()
        loss.backward()
        result["loss"] = loss.detach()

    peak = peak_tensor_bytes(forward_backward, ids.device.type)
    return result["loss"], [p.grad for p in model.parameters()], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--tiles", type=int, default=8)
    args = parser.parse_args()
    config = tiny(args.seq)
    ids = torch.randint(0, config.vocab_size, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    base_loss, base_grads, base_peak = step(config, ids, 1, 1)
    print(f"tiny (llama, d_model 128, vocab 4096), seq {args.seq}, batch 1, fp32")
    print("| tiling | peak tensor MiB | vs. untiled | loss diff | max grad diff (relative) |")
    print("|---|---|---|---|---|")
    for name, loss_tiles, mlp_tiles in [
        ("none", 1, 1),
        (f"loss {args.tiles}", args.tiles, 1),
        (f"mlp {args.tiles}", 1, args.tiles),
        (f"loss {args.tiles} + mlp {args.tiles}", args.tiles, args.tiles),
    ]:
        loss, grads, peak = (
            (base_loss, base_grads, base_peak)
            if loss_tiles == mlp_tiles == 1
            else (step(config, ids, loss_tiles, mlp_tiles))
        )
        grad_diff = max(((g - b).abs().max() / b.abs().max()).item() for g, b in zip(grads, base_grads))
        print(
            f"| {name} | {peak / MIB:.1f} | {peak / base_peak:.2f}x | {abs(loss - base_loss).item():.1e} "
            f"| {grad_diff:.1e} |"
        )


if __name__ == "__main__":
    main()
