"""The GPU check's parts for this round's features (bench/gpu_check.py runs them after the headline figures): what
each changes on a GPU path, against the same run without it. Each part: a correctness verdict (fp32, the features'
own tolerance) and, on a GPU, the speed and peak memory it costs or saves.

- loss_chunking: the loss whole (``tiling.loss`` 1) against chunked (fused linear cross-entropy: the head's
  gradients formed in the loss's forward, model/chunked_loss.py), on gpt2-125m at the speed part's micro-batch, where
  the default ("auto") already chunks: 12·T·V of the whole loss is 18.4 GiB at micro-batch 32. Expected: the chunked
  rows (the speed part's) at least as fast as the whole loss's, with less peak memory;
- moe_recompute: a mixture of experts with activation checkpointing against without (the router losses' gradient
  reaches the router through the checkpoint), then its speed on a GPU;
- windowed_attention: sliding windows (3 local blocks, 1 global, as Gemma 3's pattern) with sinks (GPT-OSS) through
  FlexAttention's block mask on a GPU against the dense mask on the CPU, then its speed against full attention;
- sft_loss: instruction tuning's masked loss (scripts/demo-sft's conversations) on a GPU against the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

from gpu_parts import CONFIGS, ROOT, Check, compare, peak_gib, speed, status

ON_CPU = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}  # the reference run of a device comparison
WINDOWED = [
    "model.sliding_window=32",
    "model.layer_types=[sliding_attention, sliding_attention, sliding_attention, full_attention]",
    "model.attention_sinks=true",
]


def _config(check: Check, name: str, base: str, **sections) -> object:
    return check.config_file(name, json.loads((CONFIGS / base).read_text()) | sections)


def loss_chunking(check: Check, steps: int, speed_plan: tuple | None) -> list[dict]:
    """Chunked against whole on tiny (fp32, 1e-6 relative), then gpt2-125m's speed and memory with the loss whole
    beside the speed part's rows (chunked by default, fused: no recompute of the head)."""
    whole = check.train("loss-whole", "tiny", _config(check, "loss-whole", "zero1.json", tiling={"loss": 1}), [], steps)
    chunked = check.train(
        "loss-chunked", "tiny", _config(check, "loss-chunked", "zero1.json", tiling={"loss": 4}), [], steps
    )
    rows = [compare(check, "chunked loss (4) vs whole", chunked, whole, 1e-6, steps)]
    if speed_plan:
        recipe, seq, micros, _ = speed_plan
        rows += speed(check, recipe, seq, micros, ["loss_whole"], steps)
    return rows


def moe_recompute(check: Check, steps: int, on_gpu: bool) -> list[dict]:
    """tiny-moe with activation checkpointing against without (fp32, 1e-6), then both in bf16 for speed and memory."""
    plain = _config(check, "moe-plain", "zero1.json")
    recompute = _config(check, "moe-recompute", "zero1.json", activation_checkpointing={})
    runs = {
        name: check.train(f"moe-{name}", "tiny-moe", path, [], steps)
        for name, path in (("plain", plain), ("recompute", recompute))
    }
    rows = [compare(check, "MoE recompute vs not", runs["recompute"], runs["plain"], 1e-6, steps)]
    if on_gpu:
        for name, base, sections in (
            ("plain-bf16", "zero1_bf16.json", {}),
            ("recompute-bf16", "zero1_bf16.json", {"activation_checkpointing": {}}),
        ):
            run = check.train(f"moe-{name}", "tiny-moe", _config(check, f"moe-{name}", base, **sections), [], steps)
            rows.append(_speed_row(f"tiny-moe {name}", run))
    return rows


def windowed_attention(check: Check, steps: int) -> list[dict]:
    """tiny with WINDOWED on this device against the CPU's dense mask (fp32, 1e-4, as document masking), then its
    speed and peak memory beside full attention's."""
    import torch

    config = _config(check, "window-zero1", "zero1.json")
    windowed = check.train("window-device", "tiny", config, WINDOWED, steps)
    if not torch.cuda.is_available():
        return [check.verdict("windows and sinks, this device", windowed["rc"] == 0, f"{status(windowed)}; no CUDA")]
    dense = check.train("window-cpu", "tiny", config, WINDOWED, steps, env=ON_CPU)
    full = check.train("window-full", "tiny", config, [], steps)
    return [
        compare(check, "windows and sinks: FlexAttention (GPU) vs dense mask (CPU)", windowed, dense, 1e-4, steps),
        _speed_row("tiny windowed", windowed),
        _speed_row("tiny full attention", full),
    ]


def sft_loss(check: Check, steps: int) -> list[dict]:
    """tiny from random weights tuned on scripts/demo-sft's conversations (prepared with the demo corpus's tokenizer,
    --chat: the loss mask) on this device, against the same run on the CPU (fp32, 1e-4)."""
    import torch

    chat = check.work / "pydocs-chat"
    if not (chat / "manifest.json").exists():
        raw = check.work / "pydocs-chat.jsonl"
        corpus = [sys.executable, "-m", "dstrain.data.chat_corpus", str(raw), "--max-examples", "400"]
        subprocess.run(corpus, env=check.env, check=True, capture_output=True)
        template = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
        prepare = ["prepare", "--dataset", str(raw), "--tokenizer", str(check.data / "tokenizer"), "--chat"]
        prepare += ["--chat-template", str(template), "--out", str(chat)]
        subprocess.run([sys.executable, "-m", "dstrain", *prepare], env=check.env, check=True, capture_output=True)
    config = _config(check, "sft-zero1", "zero1.json")
    tuning = [f"data.sources=[{{path: {chat}}}]", "data.sft=true", "data.overlong=truncate"]
    run = check.train("sft-device", "tiny", config, tuning, steps)
    if not torch.cuda.is_available():
        return [check.verdict("SFT masked loss, this device", run["rc"] == 0, f"{status(run)}; no CUDA")]
    reference = check.train("sft-cpu", "tiny", config, tuning, steps, env=ON_CPU)
    return [compare(check, "SFT masked loss: GPU vs CPU", run, reference, 1e-4, steps)]


def _speed_row(name: str, run: dict) -> dict:
    """Tokens per second (the best logged step after the first third) and peak device memory of one run."""
    timed = run["records"][len(run["records"]) // 3 :]
    return {
        "check": name,
        "ok": run["rc"] == 0,
        "detail": status(run),
        "tokens_per_s": max((r.get("tokens_per_s") or 0 for r in timed), default=None),
        "mem_peak_gib": peak_gib(run),
    }
