"""The CPU demo's verifiable task for RL (recipes/grpo-tiny.yaml, scripts/demo-rl): copy a word. Each prompt shows
two examples and asks for a third word, drawn from the Python standard library's module names (words the demo's
tiny model read in pretraining):

    os -> os. json -> json. socket ->

``copy_reward`` gives 1 when the completion's first word is the asked word, 0.25 when the word appears later, else 0.
``python -m dstrain.tasks.copy_task OUT.jsonl`` writes the prompts (a ``prompt`` and a ``word`` column).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

WORDS = (
    "os sys json re math time random socket string struct array queue heapq bisect copy pickle shutil glob "
    "logging argparse csv zlib gzip hashlib hmac secrets uuid typing enum abc functools itertools operator "
    "pathlib tempfile io signal select threading subprocess sched contextlib dataclasses inspect ast dis "
    "tokenize token keyword unittest doctest pdb timeit trace gc weakref types decimal fractions statistics "
    "cmath numbers datetime calendar collections pprint textwrap difflib codecs unicodedata locale gettext"
).split()


def copy_reward(prompts, completions, word, **_) -> list[float]:
    """1: the completion's first word is the asked word; 0.25: the word is in it elsewhere; 0 otherwise."""
    rewards = []
    for completion, asked in zip(completions, word):
        words = re.findall(r"[A-Za-z_]+", completion)
        rewards.append(1.0 if words[:1] == [asked] else 0.25 if asked in words else 0.0)
    return rewards


def prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, asked = rng.sample(WORDS, 3)
        rows.append({"prompt": f"{a} -> {a}. {b} -> {b}. {asked} ->", "word": asked})
    return rows


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in prompts(2000)), encoding="utf-8")
    print(f"wrote {out}: 2000 copy prompts")
