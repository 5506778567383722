"""The CPU demo's verifiable task for RL (recipes/grpo-tiny.yaml, scripts/demo-rl): continue a count. Each prompt is
three consecutive numbers, and the answer is the fourth:

    17, 18, 19,

Two rewards, weighted in the recipe: ``digit_share``, the share of the completion's visible characters that are
digits (dense: the demo's tiny model, pretrained on prose, rarely writes numbers), and ``next_number``, 1 when the
completion's first number is the next one. ``python -m dstrain.tasks.count_task OUT.jsonl`` writes the prompts (a
``prompt`` and a ``next`` column).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path


def digit_share(prompts, completions, **_) -> list[float]:
    """The share of each completion's non-space characters that are digits (0 for an empty completion)."""
    shares = []
    for completion in completions:
        visible = [ch for ch in completion if not ch.isspace()]
        shares.append(sum(ch.isdigit() for ch in visible) / len(visible) if visible else 0.0)
    return shares


def next_number(prompts, completions, next, **_) -> list[float]:  # noqa: A002 - the dataset's column name
    """1 when the completion's first number is the row's ``next``, else 0."""
    firsts = [re.findall(r"\d+", completion)[:1] for completion in completions]
    return [1.0 if first == [str(want)] else 0.0 for first, want in zip(firsts, next)]


def prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        n = rng.randint(1, 60)
        rows.append({"prompt": f"{n}, {n + 1}, {n + 2},", "next": n + 3})
    return rows


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in prompts(2000)), encoding="utf-8")
    print(f"wrote {out}: 2000 count prompts")
