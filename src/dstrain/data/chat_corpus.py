"""Conversations for the instruction-tuning demo and tests, built deterministically from real text.

No installed package ships a conversational corpus, so the conversations are made from the corpus of
dstrain.data.corpus (the Python standard library's own documentation, which every Python ships): for each
``pydoc_data.topics`` entry and each module docstring, a user asks about the topic or module in one of a few fixed
phrasings and the assistant answers with the text's first paragraph; where the text has a second paragraph, the user
asks for more and the assistant answers with it. Every third conversation starts with a system turn. The questions
are templated; the answers are the documentation's own words.

Run ``python -m dstrain.data.chat_corpus OUT.jsonl [--max-examples N]`` (one ``{"messages": [...]}`` per line).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from dstrain.data.corpus import SKIPPED_DIRS

SYSTEM = "You answer questions about Python and its standard library, in the words of its documentation."
TOPIC_QUESTIONS = ("What is {} in Python?", "Explain {} in Python.", "How does {} work in Python?")
MODULE_QUESTIONS = ("What does the Python module {} do?", "What is the {} module for?", "Tell me about {}.")
FOLLOW_UP = "Tell me more."
MAX_ANSWER_CHARS = 600
MIN_ANSWER_CHARS = 40


def _paragraphs(text: str) -> list[str]:
    """Non-empty paragraphs, each joined onto one line and cut at a sentence end near MAX_ANSWER_CHARS."""
    paragraphs = []
    for block in text.strip().split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if any(line and len(set(line)) == 1 and line[0] in "*=-~^" for line in lines) or "::=" in block:
            continue  # a heading and its underline, or a grammar rule: not an answer
        line = " ".join(block.split())
        if len(line) > MAX_ANSWER_CHARS:
            cut = line.rfind(". ", 0, MAX_ANSWER_CHARS)
            line = line[: cut + 1] if cut > MIN_ANSWER_CHARS else line[:MAX_ANSWER_CHARS]
        if len(line) >= MIN_ANSWER_CHARS:
            paragraphs.append(line)
    return paragraphs


def _subjects() -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(subject, its documentation, the questions to ask about it), in a fixed order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield name.replace("-", " "), topics[name], TOPIC_QUESTIONS
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("_"):
                continue
            path = Path(root) / name
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    doc = ast.get_docstring(ast.parse(path.read_bytes(), filename=str(path)))
            except (SyntaxError, ValueError):
                continue
            if doc:
                module = ".".join(path.relative_to(stdlib).with_suffix("").parts)
                yield module, doc, MODULE_QUESTIONS


def stdlib_conversations(max_examples: int | None = None) -> Iterator[list[dict]]:
    """The conversations, in their fixed order (the first ``max_examples`` only, if given)."""
    count = 0
    for subject, text, questions in _subjects():
        paragraphs = _paragraphs(text)
        if not paragraphs or (max_examples is not None and count >= max_examples):
            if max_examples is not None and count >= max_examples:
                return
            continue
        messages = [{"role": "system", "content": SYSTEM}] if count % 3 == 0 else []
        messages += [
            {"role": "user", "content": questions[count % len(questions)].format(subject)},
            {"role": "assistant", "content": paragraphs[0]},
        ]
        if len(paragraphs) > 1:
            messages += [{"role": "user", "content": FOLLOW_UP}, {"role": "assistant", "content": paragraphs[1]}]
        yield messages
        count += 1


def write_chat_corpus(path: str | os.PathLike, max_examples: int | None = None) -> int:
    """Write the conversations as jsonl of ``{"messages": [...]}``; returns how many."""
    count = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for messages in stdlib_conversations(max_examples):
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_pair_corpus(path: str | os.PathLike, max_examples: int | None = None) -> int:
    """Preference pairs of the conversations' first exchanges (TRL's explicit-prompt format): the prompt is the turns
    before the first answer, chosen the real answer, rejected the next conversation with a follow-up's second answer
    (another subject's; never a chosen answer, so no pair's training pushes down another's chosen one); written as
    jsonl, returns how many. Deterministic, as the conversations are."""
    conversations = list(stdlib_conversations(max_examples))
    firsts = [next(i for i, x in enumerate(m) if x["role"] == "assistant") for m in conversations]
    seconds = [m[-1] for m, i in zip(conversations, firsts) if len(m) > i + 1]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for k, (messages, i) in enumerate(zip(conversations, firsts)):
            chosen, rejected = messages[i], seconds[k % len(seconds)]
            if chosen["content"] == rejected["content"]:
                continue
            row = {"prompt": messages[:i], "chosen": [chosen], "rejected": [rejected]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstrain.data.chat_corpus", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output .jsonl file")
    parser.add_argument("--max-examples", type=int, default=None, help="stop after this many conversations")
    parser.add_argument("--pairs", action="store_true", help="write preference pairs: the real answer chosen, the "
                        "next conversation's rejected")  # fmt: skip
    args = parser.parse_args(argv)
    if args.pairs:
        print(f"wrote {write_pair_corpus(args.out, args.max_examples):,} preference pairs to {args.out}")
        return 0
    print(f"wrote {write_chat_corpus(args.out, args.max_examples):,} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
