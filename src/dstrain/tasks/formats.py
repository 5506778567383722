"""The standard Hugging Face dataset formats of the tasks, turned into lm-evaluation-harness's requests.

Each function reproduces, zero-shot, the task definition lm-evaluation-harness 0.4.13 ships (its YAML and
``utils.py`` under ``lm_eval/tasks/<task>/``): the same context and continuation strings (the continuation
starts with the task's ``target_delimiter``, a space), the same gold index, and the same strings whose character
lengths normalise ``acc_norm``. ``tests/test_tasks.py`` checks them item by item against lm-eval itself.
Torch-free: the recipe's checks use the names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

TARGET_DELIMITER = " "


@dataclass(frozen=True)
class Item:
    """One scored question. ``kind`` "choice": the prediction is the request of highest log-likelihood (``acc``),
    or of highest log-likelihood per character of its ``choices`` string (``acc_norm``). ``kind`` "greedy": one
    request, right when every continuation token is the model's argmax (LAMBADA's ``acc``)."""

    requests: tuple[tuple[str, str], ...]  # (context, continuation) pairs, scored by log P(continuation | context)
    gold: int  # the index of the right request
    choices: tuple[str, ...]  # lm-eval's doc_to_choice strings: their lengths normalise acc_norm
    kind: Literal["choice", "greedy"] = "choice"
    normalised: bool = True  # whether lm-eval's task reports acc_norm (Winogrande's does not)


def _hellaswag_text(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(doc: dict) -> Item:
    """Rowan/hellaswag: activity_label, ctx_a, ctx_b, endings (4), label."""
    query = _hellaswag_text(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    choices = tuple(_hellaswag_text(ending) for ending in doc["endings"])
    return _choice(query, choices, int(doc["label"]))


def arc(doc: dict) -> Item:
    """allenai/ai2_arc (ARC-Easy, ARC-Challenge): question, choices {text, label}, answerKey."""
    gold = list(doc["choices"]["label"]).index(doc["answerKey"])
    return _choice(f"Question: {doc['question']}\nAnswer:", tuple(doc["choices"]["text"]), gold)


def piqa(doc: dict) -> Item:
    """PIQA (baber/piqa): goal, sol1, sol2, label."""
    return _choice(f"Question: {doc['goal']}\nAnswer:", (doc["sol1"], doc["sol2"]), int(doc["label"]))


def winogrande(doc: dict) -> Item:
    """allenai/winogrande: sentence with one "_", option1, option2, answer ("1" or "2"). Partial scoring: each option
    fills the blank in the context, and the same rest of the sentence is scored after each."""
    sentence = doc["sentence"]
    blank = sentence.index("_")
    contexts = tuple(sentence[:blank] + option for option in (doc["option1"], doc["option2"]))
    rest = TARGET_DELIMITER + sentence[blank + 1 :].strip()
    gold = {"1": 0, "2": 1}[str(doc["answer"])]
    return Item(tuple((context, rest) for context in contexts), gold, contexts, normalised=False)


def lambada(doc: dict) -> Item:
    """EleutherAI/lambada_openai: text; the last word (after the last space) is predicted greedily."""
    words = doc["text"].split(" ")
    return Item(((" ".join(words[:-1]), " " + words[-1]),), 0, (words[-1],), kind="greedy", normalised=False)


def _choice(context: str, choices: tuple[str, ...], gold: int) -> Item:
    return Item(tuple((context, TARGET_DELIMITER + choice) for choice in choices), gold, choices)


FORMATS: dict[str, Callable[[dict], Item]] = {
    "hellaswag": hellaswag,
    "arc": arc,
    "piqa": piqa,
    "winogrande": winogrande,
    "lambada": lambada,
}

# lm-evaluation-harness's own definition of each format (under lm_eval/tasks/), which `dstrain eval --harness`
# includes in the task YAML it writes: the referee reads the items with its code, not ours.
HARNESS_TASKS = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc": "arc/arc_easy.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "lambada": "lambada/lambada_openai.yaml",
}
