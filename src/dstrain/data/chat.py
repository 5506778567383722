"""Conversations into token ids and a loss mask: what ``dstrain prepare --chat`` writes for each example.

The mask marks the tokens the model must learn to produce (1) and those it only reads (0):

* ``messages`` (a list of ``{role, content}``): every assistant turn, from the end of the template's generation
  prompt (the assistant's role header) to its end-of-turn token(s); nothing of system, user or tool turns, nor of
  the role headers. A template with ``{% generation %}`` markers says itself which characters those are
  (transformers' ``return_assistant_tokens_mask``, what TRL's ``assistant_only_loss`` uses). Most published
  templates (Llama 3.x, Qwen2.5) have none: then each assistant turn's span is what rendering the conversation up
  to and including it adds to rendering it up to its generation prompt, cut after the last non-blank text
  (``<|im_end|>\\n`` learns ``<|im_end|>``; the newline is never generated). The span is checked: the template must
  render each beginning of the conversation as the beginning of the whole, no token may straddle the span's edges,
  and the span's tokens must decode to text holding the assistant's content; an example that fails is refused in
  one line, never trained on every token.
* ``prompt``/``completion``: the completion's tokens, as TRL's ``completion_only_loss`` takes them (the tokens past
  the longest common prefix of the prompt rendered alone, with its generation prompt, and of the whole); a plain-text
  pair is ``tokenizer(prompt + completion + eos)``.

The ids are ``apply_chat_template(messages, tokenize=True)``'s, exactly what TRL trains on (no EOS appended).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from dstrain.errors import DstrainError

ROLES = ("system", "user", "assistant", "tool")
GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
FORMATS = ("messages", "prompt-completion")


class ExampleError(ValueError):
    """One example cannot be encoded; the caller names the dataset and row."""


def load_chat_template(tokenizer, template_file: str | None, tokenizer_name: str) -> str:
    """The template to render with: ``--chat-template FILE`` if given, else the tokenizer's own."""
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise DstrainError(f"--chat-template {template_file}: no such file; pass a Jinja chat template file")
        return path.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise DstrainError(
            f"tokenizer {tokenizer_name} (--tokenizer) has no chat_template; pass one with --chat-template FILE "
            f"(a Jinja template, e.g. the model family's chat_template.jinja)"
        )
    return template


def has_generation_markers(template: str) -> bool:
    return GENERATION_MARKER.search(template) is not None


def template_hash(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def example_format(columns: list[str]) -> str:
    """``messages`` or ``prompt-completion`` from a dataset's columns, or a one-line refusal."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt-completion"
    raise DstrainError(
        f"--chat: the dataset has neither a 'messages' column nor 'prompt' and 'completion' columns "
        f"(it has: {', '.join(columns) or 'none'}); rename the conversation column to 'messages'"
    )


def check_messages(messages, what: str = "messages") -> list[dict]:
    """The messages as plain dicts with a known role and non-empty text content, else ExampleError."""
    if not isinstance(messages, list) or not messages:
        raise ExampleError(f"{what} is {'empty' if isinstance(messages, list) else type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ExampleError(f"{what}[{i}] is not a {{role, content}} message")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ExampleError(f"{what}[{i}] has the unknown role {role!r} (known: {', '.join(ROLES)})")
        if not isinstance(content, str) or not content.strip():
            raise ExampleError(f"{what}[{i}] ({role}) has an empty content")
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


def _render(tokenizer, template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateError as e:  # the template's own raise_exception(...) message
        raise ExampleError(f"the chat template refuses it: {e}") from None


def _tokenize(tokenizer, text: str):
    return tokenizer(text, add_special_tokens=False)


def _learned_end(span: str, content: str) -> int:
    """Where the learned part of an assistant span ends: after its content and the end-of-turn text that follows,
    before trailing whitespace."""
    at = span.find(content.strip())
    if at < 0:
        raise ExampleError(
            "the template's rendering of an assistant turn does not hold its content (it rewrites it); use a "
            "template with {% generation %} markers (--chat-template)"
        )
    return len(span.rstrip())


def _spans_by_prefixes(tokenizer, template: str, messages: list[dict]) -> tuple[str, list[tuple[int, int, str]]]:
    """The rendered conversation and (start, end, content) of each assistant turn's learned characters."""
    full = _render(tokenizer, template, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, template, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, template, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ExampleError(
                f"the chat template renders the conversation up to message {i} otherwise than as the beginning of "
                f"the whole, so the assistant's tokens cannot be told apart; use a template with "
                f"{{% generation %}} markers (--chat-template)"
            )
        end = len(before) + _learned_end(upto[len(before) :], message["content"])
        spans.append((len(before), end, message["content"]))
    return full, spans


def _mask_of_spans(tokenizer, full: str, spans: list[tuple[int, int, str]]) -> tuple[list[int], np.ndarray]:
    encoding = _tokenize(tokenizer, full)
    ids = list(encoding["input_ids"])
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end, content in spans:
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:
            raise ExampleError("an assistant turn's span covers no tokens")
        if encoding.token_to_chars(first).start < start or encoding.token_to_chars(last).end > end:
            raise ExampleError(
                "a token straddles the edge of an assistant turn (the role header or the end-of-turn merges with "
                "its content), so the learned tokens cannot be told apart; use a template with "
                "{% generation %} markers (--chat-template)"
            )
        decoded = tokenizer.decode(ids[first : last + 1], skip_special_tokens=False)
        if content.strip() not in decoded:
            raise ExampleError("an assistant turn's tokens do not decode to its content")
        mask[first : last + 1] = 1
    return ids, mask


def check_conversation(messages) -> list[dict]:
    """A conversation's messages (check_messages), with an assistant turn and a turn before the first; else
    ExampleError."""
    messages = check_messages(messages)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ExampleError("the conversation has no assistant turn (nothing to learn)")
    if roles[0] == "assistant":
        raise ExampleError("the conversation starts with an assistant turn; put the prompt's turn before it")
    return messages


def check_example(fmt: str, example: dict) -> None:
    """What can be checked of an example without rendering it (roles, contents, an assistant turn to learn)."""
    if fmt == "messages":
        check_conversation(example["messages"])
        return
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        check_messages(prompt, "prompt")
        if not any(m["role"] == "assistant" for m in check_messages(completion, "completion")):
            raise ExampleError("the completion has no assistant turn (nothing to learn)")
        return
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str) or not value.strip():
            raise ExampleError(f"{name} is empty" if isinstance(value, str) else f"{name} is not text")


def encode_messages(tokenizer, template: str, messages) -> tuple[list[int], np.ndarray]:
    """(ids, loss mask) of a conversation; see the module docstring."""
    messages = check_conversation(messages)
    if not has_generation_markers(template):
        return _mask_of_spans(tokenizer, *_spans_by_prefixes(tokenizer, template, messages))
    from jinja2.exceptions import TemplateError

    try:
        out = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except TemplateError as e:
        raise ExampleError(f"the chat template refuses it: {e}") from None
    ids, mask = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
    if not mask.any():
        raise ExampleError("the template's {% generation %} markers mark no token of any assistant turn")
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    for message in messages:
        if message["role"] == "assistant" and message["content"].strip() not in learned:
            raise ExampleError("the template's {% generation %} markers leave out an assistant turn's content")
    return ids, mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_prompt_completion(tokenizer, template: str | None, prompt, completion) -> tuple[list[int], np.ndarray]:
    """(ids, loss mask) of a prompt/completion pair: the completion is learned (TRL's completion_only_loss)."""
    check_example("prompt-completion", {"prompt": prompt, "completion": completion})
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt, completion = check_messages(prompt, "prompt"), check_messages(completion, "completion")
        from jinja2.exceptions import TemplateError

        try:
            prompt_ids = tokenizer.apply_chat_template(
                prompt, chat_template=template, tokenize=True, return_dict=True, add_generation_prompt=True
            )["input_ids"]
            ids = tokenizer.apply_chat_template(
                prompt + completion, chat_template=template, tokenize=True, return_dict=True
            )["input_ids"]
        except TemplateError as e:
            raise ExampleError(f"the chat template refuses it: {e}") from None
    else:
        eos = tokenizer.eos_token
        text = prompt + completion + ("" if completion.endswith(eos) else eos)
        prompt_ids, ids = tokenizer(text=prompt)["input_ids"], tokenizer(text=text)["input_ids"]
    ids = list(ids)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[_common_prefix(list(prompt_ids), ids) :] = 1
    if not mask.any():
        raise ExampleError("the completion adds no token")
    return ids, mask


class ChatEncoder:
    """Encodes examples in this process (rendering a Jinja template needs transformers' tokenizer, not only the Rust
    one the text encoder's workers hold; an SFT corpus is small). ``read(source, start)`` yields, per batch of
    examples, (ids back to back, each example's size, its mask back to back), as ParallelEncoder.read does."""

    masked = True

    def __init__(self, tokenizer, template: str, fmt: str, dtype: np.dtype, batch_docs: int = 1000):
        self.tokenizer, self.template, self.format = tokenizer, template, fmt
        self.dtype, self.batch_docs = np.dtype(dtype), batch_docs

    def __enter__(self) -> ChatEncoder:
        return self

    def check(self, source) -> None:
        """Every example's structure, before anything is written (a source that can be read twice: not a stream);
        the first bad row refused in one line. A template's own refusal shows when the example is rendered."""
        from dstrain.data.sources import example_batches

        row = 0
        for examples in example_batches(source, 0, self.batch_docs):
            for example in examples:
                try:
                    self.check_example(example)
                except ExampleError as e:
                    raise DstrainError(
                        f"--dataset {source.spec.dataset!r} row {row}: {e}; fix or drop that example"
                    ) from None
                row += 1

    def __exit__(self, *exc) -> None:
        pass

    def check_example(self, example: dict) -> None:
        check_example(self.format, example)

    def documents(self, example: dict) -> list[tuple[list[int], np.ndarray]]:
        """(ids, loss mask) of each document an example makes: one here (two for a preference pair: data/pairs.py)."""
        return [self.encode(example)]

    def encode(self, example: dict) -> tuple[list[int], np.ndarray]:
        if self.format == "messages":
            return encode_messages(self.tokenizer, self.template, example["messages"])
        return encode_prompt_completion(self.tokenizer, self.template, example["prompt"], example["completion"])

    def read(self, source, start: int):
        from dstrain.data.sources import example_batches

        row = start
        for examples in example_batches(source, start, self.batch_docs):
            id_lists, masks = [], []
            for example in examples:
                try:
                    documents = self.documents(example)
                except ExampleError as e:
                    raise DstrainError(
                        f"--dataset {source.spec.dataset!r} row {row}: {e}; fix or drop that example"
                    ) from None
                id_lists += [ids for ids, _ in documents]
                masks += [mask for _, mask in documents]
                row += 1
            sizes = np.fromiter((len(ids) for ids in id_lists), dtype=np.int64, count=len(id_lists))
            flat = np.fromiter((t for ids in id_lists for t in ids), dtype=self.dtype, count=int(sizes.sum()))
            yield flat, sizes, np.concatenate(masks) if masks else np.zeros(0, np.uint8)


def end_of_turn_ids(tokenizer, template: str | None = None) -> list[int]:
    """The token ids that end an assistant turn in ``template`` (the tokenizer's own if None), followed by the EOS:
    what generation stops at (transformers' generate, an inference server through generation_config.json). The end
    of turn is what the template renders after an assistant's content, where that is special tokens (<|im_end|>,
    <|eot_id|>, the EOS); a template that ends turns with plain text has none but the EOS."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
    text = tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    after = text[text.rindex("Yes") + len("Yes") :].strip()
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ends = [i for i in ids if i in special] if ids and all(i in special for i in ids) else []
    return list(dict.fromkeys([*ends, tokenizer.eos_token_id]))
