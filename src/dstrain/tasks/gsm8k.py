"""GSM8K's verifiable reward for RL (recipes/grpo-qwen2.5-0.5b-gsm8k.yaml): exact match of the final number.

The reference answer is the text after ``####`` in the dataset's ``answer`` column. A completion's answer is the
number after its own ``####`` if it writes one, else its last number (Qwen2.5-Instruct answers in prose or with
\\boxed{}); commas and a trailing ``.0`` are dropped before comparing. Written here rather than through math-verify:
GSM8K's answers are integers, and a plain comparison is what veRL's gsm8k reward does.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number a text answers with (module doc), normalised; None when it has none."""
    tail = text.split("####")[-1] if "####" in text else text
    boxed = re.findall(r"\\boxed\{([^}]*)\}", tail)
    found = NUMBER.findall(boxed[-1] if boxed else tail)
    if not found:
        return None
    number = found[0] if "####" in text else found[-1]
    number = number.replace(",", "").replace("$", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def exact_match(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's final number equals the reference's (``answer``: GSM8K's column), else 0.0."""
    return [
        1.0 if (got := final_number(completion)) is not None and got == final_number(reference) else 0.0
        for completion, reference in zip(completions, answer)
    ]
