"""The preference step's cost, side by side in one run (CPU, fp32, a world of one), in two parts:

- ``loss``: one forward + backward of the tiny model over the same packed micro-batch of pairs, with the SFT loss
  (token_loss_sum over the learned tokens) and with the DPO loss (dstrain.train.objectives.preference.losses: each
  completion's
  log-prob sum from the packed forward, against stored reference scores, so no second model); the ratio DPO ÷ SFT
  of the median of ``--repeats`` interleaved timings.
- ``trainer``: dstrain's Trainer on a real pair folder (the stdlib pairs of dstrain.data.chat_corpus, prepared with
  role-lines.jinja) under recipes/dpo-tiny.yaml, its model a random tiny Llama saved as init_from: Trainer.fit's
  train_step with ``preference:`` (the preference step: its pair-count all-reduce, the log-prob sums, the loss)
  against the same recipe without it (the SFT step on the same samples, both completions learned), in alternating
  blocks; and the DPO trainer's reference pass before step 1 (dstrain.train.objectives.preference.steps.reference_pass:
  the
  engine's no-grad forwards, its kept scores deleted first so that it computes them) against one epoch of training
  on the same pairs (the train split's steps x the DPO step's median).

    OMP_NUM_THREADS=1 python bench/bench_dpo.py [--part loss|trainer|all] [--seq 1024] [--batch 4] [--repeats 9]
        [--blocks 3] [--steps 8] [--pairs 240 | --pair-folder DIR] [--seq-len 128] [--d-model 128] [--layers 4]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dstrain.data.dataset import collate
from dstrain.data.pair_packing import pair_sample
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT, token_loss_sum
from dstrain.objectives.preference_config import PreferenceConfig
from dstrain.train.objectives.preference.losses import PairCounts, PairLogps, completion_logps, loss_share


def packed_pairs(seq: int, batch: int, vocab: int, seed: int = 1) -> dict:
    """``batch`` samples, each packed with pairs of a 40-100 token prompt and 20-120 token completions."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(batch):
        sides, used = [], 0
        while True:
            prompt = rng.integers(0, vocab, rng.integers(40, 100))
            answers = [rng.integers(0, vocab, rng.integers(20, 120)) for _ in range(2)]
            if used + 2 * prompt.size + sum(a.size for a in answers) > seq + 1:
                break
            for answer in answers:
                ids = np.concatenate([prompt, answer])
                mask = np.concatenate([np.zeros(prompt.size, np.uint8), np.ones(answer.size, np.uint8)])
                sides.append((ids, mask))
                used += ids.size
        samples.append(pair_sample(sides, seq, pad_id=0))
    return collate(samples)


def timed(model: GPT, batch: dict, loss_of) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logits = model(batch["input_ids"], batch["position_ids"])
    loss_of(logits).backward()
    return time.perf_counter() - start


def loss_part(args: argparse.Namespace) -> None:
    config = GPTConfig(flavour="llama", vocab_size=4096, max_seq_len=args.seq, n_layer=4, n_head=4, n_kv_head=2,
                       d_model=128, doc_masking=True)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    batch = packed_pairs(args.seq, args.batch, config.vocab_size)
    labels, learned = batch["labels"], int((batch["labels"] != -100).sum())
    with torch.no_grad():  # the reference scores, stored before training: here the initial model's
        reference = completion_logps(model(batch["input_ids"], batch["position_ids"]), labels, batch["documents"])
    pairs = reference.chosen.numel()
    preference = PreferenceConfig()
    counts = PairCounts(pairs=pairs, chosen_tokens=float(reference.chosen_tokens.sum()))

    def sft(logits):
        return token_loss_sum(logits, labels) / learned

    def dpo(logits):
        policy = completion_logps(logits, labels, batch["documents"])
        logps = PairLogps(policy.chosen, policy.rejected, reference.chosen, reference.rejected,
                          policy.chosen_tokens, policy.rejected_tokens)  # fmt: skip
        return loss_share(preference, logps, counts)

    times: dict[str, list[float]] = {"sft": [], "dpo": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, loss_of in (("sft", sft), ("dpo", dpo)):
            times[name].append(timed(model, batch, loss_of))
    sft_s, dpo_s = (statistics.median(times[name][1:]) for name in ("sft", "dpo"))
    print(f"tiny (llama, d_model 128, vocab 4096), {args.batch} x {args.seq} tokens, {pairs} pairs, fp32, CPU")
    print(f"SFT step {sft_s * 1e3:.1f} ms, DPO step {dpo_s * 1e3:.1f} ms (median of {args.repeats})")
    print(f"DPO / SFT: {dpo_s / sft_s:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("loss", "trainer", "all"), default="all")
    parser.add_argument("--seq", type=int, default=1024, help="loss part: tokens a sample")
    parser.add_argument("--batch", type=int, default=4, help="loss part: samples")
    parser.add_argument("--repeats", type=int, default=9, help="loss part: timings of each")
    parser.add_argument("--blocks", type=int, default=3, help="trainer part: blocks of each side")
    parser.add_argument("--steps", type=int, default=8, help="trainer part: steps a block (the first 2 warm up)")
    parser.add_argument("--pairs", type=int, default=240, help="trainer part: conversations the pairs come from")
    parser.add_argument("--pair-folder", type=Path, default=None, help="trainer part: a prepared pair folder instead")
    parser.add_argument("--seq-len", type=int, default=128, help="trainer part: tokens a sample (dpo-tiny's 128)")
    parser.add_argument("--d-model", type=int, default=128, help="trainer part: the model's width (tiny's 128)")
    parser.add_argument("--layers", type=int, default=4, help="trainer part: the model's blocks (tiny's 4)")
    parser.add_argument("--json", type=Path, default=None, help="trainer part: write its figures here")
    args = parser.parse_args()
    if args.part in ("loss", "all"):
        loss_part(args)
    if args.part in ("trainer", "all"):
        from bench_dpo_trainer import trainer_part

        figures = trainer_part(args)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
