"""Training throughput (forward + backward tokens/s) of our GPT vs the equivalent Hugging Face model.

For each flavour the HF model (GPT2LMHeadModel / LlamaForCausalLM) is built by dstrain.model.hf.convert.to_hf
from our model, so dimensions and weights are identical; both run in train mode, in the same dtype,
with PyTorch SDPA attention, the same loss (lm_loss), and HF's KV cache off (as in training). Steps
alternate between the two models so that load from other processes hits both alike.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_model.py [--repeats 10] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.model.config import GPTConfig  # noqa: E402
from dstrain.model.gpt import GPT, lm_loss  # noqa: E402
from dstrain.model.hf.convert import to_hf  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_pair(config: GPTConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ours = GPT(config).to(dtype).train()
    hf_config, hf_state = to_hf(config, ours.state_dict())
    hf_config.use_cache = False
    hf_class = getattr(transformers, hf_config.architectures[0])
    hf = hf_class._from_config(hf_config, attn_implementation="sdpa", dtype=dtype).train()
    hf.load_state_dict(hf_state, strict=True)
    return ours, hf


def train_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> None:
    logits = model(ids) if isinstance(model, GPT) else model(ids, use_cache=False).logits
    lm_loss(logits, labels).backward()
    model.zero_grad(set_to_none=True)


def measure(models: dict[str, torch.nn.Module], ids, labels, repeats: int, warmup: int) -> dict[str, float]:
    """Median tokens/s per model; one step of each model per repeat, interleaved."""
    for _ in range(warmup):
        for model in models.values():
            train_step(model, ids, labels)
    seconds = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            train_step(model, ids, labels)
            seconds[name].append(time.perf_counter() - start)
    return {name: ids.numel() / statistics.median(s) for name, s in seconds.items()}


def profile(model: torch.nn.Module, ids, labels, label: str) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            train_step(model, ids, labels)
    print(f"\n--- profile: {label} (3 steps) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--n-kv-head", type=int, default=2, help="llama flavour only")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler tables")
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
        f"dtype {args.dtype}, batch {args.batch} x seq {args.seq}, d_model {args.d_model}, "
        f"{args.n_layer} layers, vocab {args.vocab}"
    )
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    for flavour in ("gpt2", "llama"):
        config = GPTConfig(
            flavour=flavour,
            vocab_size=args.vocab,
            max_seq_len=args.seq,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_kv_head=args.n_kv_head if flavour == "llama" else None,
            d_model=args.d_model,
        )
        ours, hf = build_pair(config, DTYPES[args.dtype])
        hf_name = type(hf).__name__
        tokens_per_s = measure({"dstrain": ours, hf_name: hf}, ids, labels, args.repeats, args.warmup)
        ratio = tokens_per_s["dstrain"] / tokens_per_s[hf_name]
        print(
            f"{flavour:6s} dstrain {tokens_per_s['dstrain']:9.0f} tok/s | {hf_name:17s} "
            f"{tokens_per_s[hf_name]:9.0f} tok/s | ratio {ratio:.2f}x"
        )
        if args.profile:
            profile(ours, ids, labels, f"dstrain {flavour}")
            profile(hf, ids, labels, hf_name)


if __name__ == "__main__":
    main()
