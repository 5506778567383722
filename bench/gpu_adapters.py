"""The GPU check's part for LoRA (issue 56; bench/gpu_check.py runs it with this round's features): adapters on every
linear layer of tiny under ZeRO-3 and ZeRO-2 against ZeRO-0 on the device (fp32, 1e-5: losses and pre-clip gradient
norms), then the LoRA step against the full fine-tuning step of the same recipe (bf16, zero1_bf16, world of one):
tokens per second and peak device memory of each, and LoRA ÷ full of both (bench/bench_lora.py measures the same on
a CPU)."""

from __future__ import annotations

import json

from gpu_features import _speed_row
from gpu_parts import CONFIGS, Check, compare

LORA = ["lora.rank=16", "lora.alpha=32", "lora.target_modules=[all-linear]"]
SPEED_RECIPE = ("gpt2-125m", 8)  # (recipe, micro-batch): the speed part's model
DRY_SPEED_RECIPE = ("tiny", 4)


def lora(check: Check, steps: int, dry: bool) -> list[dict]:
    rows = []
    reference = check.train("lora-zero0", "tiny", CONFIGS / "zero0.json", LORA, steps)
    for name in ("zero2", "zero3"):
        run = check.train(f"lora-{name}", "tiny", CONFIGS / f"{name}.json", LORA, steps)
        rows.append(compare(check, f"LoRA under {name} vs zero0 (tiny, fp32)", run, reference, 1e-5, steps))
    recipe, micro = DRY_SPEED_RECIPE if dry else SPEED_RECIPE
    config = check.config_file(
        "lora-speed", json.loads((CONFIGS / "zero1_bf16.json").read_text()) | {"train_micro_batch_size_per_gpu": micro}
    )
    runs = {
        name: check.train(f"lora-speed-{name}", recipe, config, extra, steps)
        for name, extra in (("full", []), ("lora", LORA))
    }
    speeds = {name: _speed_row(f"{recipe} {name} (zero1_bf16, micro {micro})", run) for name, run in runs.items()}
    rows += speeds.values()
    full, adapted = speeds["full"], speeds["lora"]
    if full["ok"] and adapted["ok"] and full["tokens_per_s"] and full["mem_peak_gib"]:
        rows.append(
            check.verdict(
                f"{recipe}: LoRA ÷ full",
                True,
                f"step time {full['tokens_per_s'] / adapted['tokens_per_s']:.3f}, "
                f"peak memory {adapted['mem_peak_gib'] / full['mem_peak_gib']:.3f}",
            )
        )
    return rows


QLORA = [*LORA, "lora.quantize_base=nf4"]


def qlora(check: Check, steps: int) -> list[dict]:
    """QLoRA (issue 56 §5): torchao's NF4 base with adapters under ZeRO-3 against ZeRO-0 on the device (tiny, fp32,
    1e-5: the NF4 bytes partitioned and gathered by NCCL as uint8), and bf16 ZeRO-3 training (torchao's dequantization
    to bf16 on the device) to its end."""
    reference = check.train("qlora-zero0", "tiny", CONFIGS / "zero0.json", QLORA, steps)
    run = check.train("qlora-zero3", "tiny", CONFIGS / "zero3.json", QLORA, steps)
    rows = [compare(check, "QLoRA under zero3 vs zero0 (tiny, fp32)", run, reference, 1e-5, steps)]
    bf16 = check.train("qlora-zero3-bf16", "tiny", CONFIGS / "zero3_bf16.json", QLORA, steps)
    finished = bf16["rc"] == 0 and len(bf16["records"]) > 0
    rows.append(check.verdict("QLoRA under zero3_bf16 (tiny) trains", finished, f"exit {bf16['rc']}"))
    return rows
