"""Chat tokenizers and conversations for the instruction-tuning tests, built offline (nothing from a hub).

A small byte-level BPE trained on a few strings, with the special tokens of ChatML, Llama 3.x and Qwen2.5, wrapped
in transformers' PreTrainedTokenizerFast with a chat template written here: ChatML with ``{% generation %}``
markers (what TRL's assistant_only_loss needs), and three without (ChatML, Llama-3.x-style, Qwen2.5-style).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]

# The shipped ChatML template with generation markers (recipes/sft-qwen3-0.6b.yaml renders with it): the referee
# tests prove it against TRL.
CHATML_GENERATION = (Path(__file__).resolve().parents[1] / "recipes/chat_templates/chatml-generation.jinja").read_text()
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5's shape: a default system turn, user/assistant alternation enforced with the template's own error.
QWEN25 = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'user' and loop.previtem is defined and loop.previtem['role'] == 'user' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3.x's shape: BOS, a system header with dates, contents trimmed, <|eot_id|> ending each turn.
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + system + "
    "'<|eot_id|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TEMPLATES = {"chatml-generation": CHATML_GENERATION, "chatml": CHATML, "qwen2.5": QWEN25, "llama3": LLAMA3}
END_OF_TURN = {
    "chatml-generation": "<|im_end|>",
    "chatml": "<|im_end|>",
    "qwen2.5": "<|im_end|>",
    "llama3": "<|eot_id|>",
}

CONVERSATIONS = [
    [
        {"role": "user", "content": "What does the len function return?"},
        {"role": "assistant", "content": "The number of items in a container."},
    ],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a mutable sequence type."},
        {"role": "assistant", "content": "A list is mutable."},
        {"role": "user", "content": "And an immutable one?"},
        {"role": "assistant", "content": "A tuple cannot be changed after it is made."},
    ],
    [
        {"role": "user", "content": "How do I open a file for reading?"},
        {"role": "assistant", "content": "Call open with the mode 'r', best inside a with statement."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
]
PROMPT_COMPLETIONS = [
    {"prompt": "The capital of France is", "completion": " Paris."},
    {"prompt": "Two plus two makes", "completion": " four, in every base above four."},
]


def chat_tokenizer(template: str = CHATML_GENERATION, eos: str = "<|endoftext|>", bos: str | None = None):
    """A fast tokenizer with the chat special tokens and ``template`` (deterministic: trained on fixed strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] + [
        p["prompt"] + p["completion"] for p in PROMPT_COMPLETIONS
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts * 4 + ["system user assistant helpful Cutting Knowledge Date December"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        bos_token=bos,
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )


def template_tokenizer(name: str):
    """The tokenizer of template ``name`` (TEMPLATES), its EOS the template's end of turn as its family has it."""
    bos = "<|begin_of_text|>" if name == "llama3" else None
    return chat_tokenizer(TEMPLATES[name], eos=END_OF_TURN[name], bos=bos)


def save_chat_tokenizer(folder: Path, name: str = "chatml-generation") -> Path:
    template_tokenizer(name).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
