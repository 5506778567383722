"""The GPU check's parts for this round's features (bench/gpu_check.py runs them after the headline figures): what
each changes on a GPU path, against the same run without it. Each part: a correctness verdict (fp32, the features'
own tolerance) and, on a GPU, the speed and peak memory it costs or saves.

- loss_chunking: the loss whole (``tiling.loss`` 1) against chunked, on gpt2-125m at the speed part's micro-batch,
  where the default ("auto") already chunks: 12·T·V of the whole loss is 18.4 GiB at micro-batch 32;
- moe_recompute: a mixture of experts with activation checkpointing against without (the router losses' gradient
  reaches the router through the checkpoint), then its speed on a GPU.
"""

from __future__ import annotations

import json

from gpu_parts import CONFIGS, Check, compare, speed, status


def _config(check: Check, name: str, base: str, **sections) -> object:
    return check.config_file(name, json.loads((CONFIGS / base).read_text()) | sections)


def loss_chunking(check: Check, steps: int, speed_plan: tuple | None) -> list[dict]:
    """Chunked against whole on tiny (fp32, 1e-6 relative), then gpt2-125m's speed and memory with the loss whole
    beside the speed part's rows (chunked by default)."""
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
            timed = run["records"][len(run["records"]) // 3 :]
            rows.append(
                {
                    "check": f"tiny-moe {name}",
                    "ok": run["rc"] == 0,
                    "detail": status(run),
                    "tokens_per_s": max((r.get("tokens_per_s") or 0 for r in timed), default=None),
                    "mem_peak_gib": round(
                        max((r.get("mem_peak_bytes") or 0 for r in run["records"]), default=0) / 2**30, 2
                    ),
                }
            )
    return rows
