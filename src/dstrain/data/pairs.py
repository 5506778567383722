"""Preference pairs into two masked documents: what ``dstrain prepare --chat`` writes for TRL's preference format.

A row holds ``chosen`` and ``rejected`` (text, or a list of ``{role, content}`` messages) and, explicitly, a
``prompt`` of the same kind; without one the prompt is implicit: the longest common prefix of ``chosen`` and
``rejected`` (TRL's ``extract_prompt``: whole messages for conversations; characters for text, the space before
the completions left to them). Each side is encoded as SFT's prompt/completion examples are
(dstrain.data.chat.encode_prompt_completion: rendered by the chat template, its mask the completion's tokens only,
checked), and the two are written as neighbouring documents, chosen first: document 2k is pair k's chosen answer,
2k + 1 its rejected one.

Refused before any shard is written, one line naming the row: a column missing, chosen equal to rejected, an empty
completion, an implicit prompt that is not a common prefix of whole turns ending before an assistant answer (or, for
text, no common prefix at all).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dstrain.data.chat import ChatEncoder, ExampleError, check_messages, encode_prompt_completion
from dstrain.errors import DstrainError


def implicit_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen's completion, rejected's completion) of a row without a prompt column: their longest common
    prefix, as TRL's extract_prompt takes it; ExampleError where it is no prompt."""
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise ExampleError("chosen and rejected are not of one kind (one text, one conversation)")
    at = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        at += 1
    if isinstance(chosen, list):
        if at == 0:
            raise ExampleError("chosen and rejected share no first turn, so there is no implicit prompt")
        answers = [side[at].get("role") if at < len(side) else None for side in (chosen, rejected)]
        if answers != ["assistant", "assistant"]:
            raise ExampleError(
                "the implicit prompt (the turns chosen and rejected share) is not followed by an assistant answer in "
                "both; add a 'prompt' column, or make both end in their own assistant answers"
            )
        return chosen[:at], chosen[at:], rejected[at:]
    if at == 0:
        raise ExampleError(
            "chosen and rejected share no common beginning, so there is no implicit prompt; add 'prompt'"
        )
    if chosen[at - 1] == " ":  # TRL leaves the space before the answers to them
        at -= 1
    return chosen[:at], chosen[at:], rejected[at:]


def split_pair(example: dict) -> tuple:
    """(prompt, chosen completion, rejected completion) of a row, explicit or implicit prompt; ExampleError where the
    pair is not one (equal answers, an empty one)."""
    chosen, rejected = example["chosen"], example["rejected"]
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, list):
            check_messages(value, name)
        elif not isinstance(value, str) or not value.strip():
            raise ExampleError(f"{name} is empty" if isinstance(value, str) else f"{name} is not text")
    if chosen == rejected:
        raise ExampleError("chosen equals rejected (nothing to prefer); drop that pair")
    prompt = example.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (isinstance(value, str) and not value.strip()):
            raise ExampleError(f"the {name} completion is empty (past the prompt)")
    return prompt, chosen, rejected


def encode_pair(tokenizer, template: str | None, example: dict) -> list[tuple[list[int], np.ndarray]]:
    """[(ids, mask) of chosen, (ids, mask) of rejected]: each the prompt and its completion, the completion learned."""
    prompt, chosen, rejected = split_pair(example)
    sides = [encode_prompt_completion(tokenizer, template, prompt, side) for side in (chosen, rejected)]
    # The completions start where the shorter of the two prompts' token prefixes ends, as TRL's DPOTrainer cuts them
    # (one prompt for both sides where a token merges across the prompt's end in one of them).
    start = min(int(np.argmax(mask)) for _, mask in sides)
    for _, mask in sides:
        mask[start:] = 1
    return sides


class PairEncoder(ChatEncoder):
    """ChatEncoder for preference rows: two documents per row, chosen then rejected."""

    def check_example(self, example: dict) -> None:
        split_pair(example)

    def documents(self, example: dict) -> list[tuple[list[int], np.ndarray]]:
        return encode_pair(self.tokenizer, self.template, example)


def pair_counts(out: Path, prefixes: list[str]) -> dict:
    """The manifest's ``pairs`` record: the pairs, the longest (chosen + rejected, packed together), and how many are
    longer than each common seq_len + 1 (packing truncates or drops them by the recipe's data.overlong)."""
    from dstrain.data.shard_writing import LENGTH_BOUNDS
    from dstrain.data.shards import ShardReader

    sizes = [ShardReader.open(out / prefix).sizes for prefix in prefixes]
    lengths = np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)
    if lengths.size % 2:
        raise DstrainError(f"{out}: {lengths.size} documents, not pairs; run `dstrain prepare` again into a new --out")
    pairs = lengths[0::2] + lengths[1::2]
    return {
        "pairs": int(pairs.size),
        "longest": int(pairs.max()) if pairs.size else 0,
        "longer_than": {str(n): int((pairs > n + 1).sum()) for n in LENGTH_BOUNDS},
    }
