"""Small task files in each standard format, a BPE tokenizer (with and without a BOS, as GPT-2 and Llama frame
their text) and random exported models, for the task scorer's tests. Items are made up here: the real datasets'
licences vary and the tests run offline."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

WORDS = (
    "the a cat dog sat ran on under over mat table house river quickly slowly red blue green big small "
    "man woman child bird fish water fire tree stone road city field sun moon star cold warm old new"
).split()


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def task_docs(fmt: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` documents of format ``fmt`` as the Hub datasets lay them out; some with the quirks lm-eval handles
    (hellaswag's [title] and double spaces, ARC's numeric answer keys, trailing spaces)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if fmt == "hellaswag":
            docs.append(
                {
                    "activity_label": _phrase(rng, 2).title(),
                    "ctx_a": _phrase(rng, 6) + ".",
                    "ctx_b": _phrase(rng, 3) + (" [title]" if i % 3 == 0 else ""),
                    "endings": [_phrase(rng, rng.randint(2, 9)) + ("  ." if i % 2 else ".") for _ in range(4)],
                    "label": str(i % 4),
                }
            )
        elif fmt == "arc":
            labels = ["1", "2", "3", "4"] if i % 4 == 3 else ["A", "B", "C", "D"]
            docs.append(
                {
                    "id": f"q{i}",
                    "question": _phrase(rng, 7) + "?",
                    "choices": {"text": [_phrase(rng, rng.randint(1, 5)) for _ in labels], "label": labels},
                    "answerKey": labels[i % 4],
                }
            )
        elif fmt == "piqa":
            docs.append({"goal": _phrase(rng, 6), "sol1": _phrase(rng, 8), "sol2": _phrase(rng, 4), "label": i % 2})
        elif fmt == "winogrande":
            docs.append(
                {
                    "sentence": f"{_phrase(rng, 4)} _ {_phrase(rng, 5)}.",
                    "option1": _phrase(rng, 1),
                    "option2": _phrase(rng, 2),
                    "answer": str(1 + i % 2),
                }
            )
        elif fmt == "lambada":
            docs.append({"text": _phrase(rng, rng.randint(6, 14))})
        else:
            raise ValueError(fmt)
    return docs


def write_task_file(folder: Path, fmt: str, n: int, seed: int = 0) -> Path:
    path = folder / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in task_docs(fmt, n, seed)))
    return path


@functools.cache
def tokenizer(bos: bool):
    """A byte-level BPE on the words above; ``bos``: a Llama-style tokenizer that starts every text with <s>."""
    from tokenizers import processors

    from dstrain.data.tokenizer import train_bpe_tokenizer

    rng = random.Random(1)
    texts = [[_phrase(rng, 20) + "? [title]." for _ in range(200)]]
    tok = train_bpe_tokenizer(iter(texts), 300, 200)
    if bos:
        tok.add_special_tokens({"bos_token": "<s>"})
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
        )
    return tok


def exported_model(folder: Path, flavour: str, seed: int = 0) -> Path:
    """A random 2-block model of ``flavour`` exported with its tokenizer (Llama's with a BOS) into ``folder``."""
    import torch

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    tok = tokenizer(bos=flavour == "llama")
    extra = {"n_kv_head": 2} if flavour == "llama" else {}
    config = GPTConfig(flavour=flavour, vocab_size=320, max_seq_len=128, n_layer=2, n_head=4, d_model=32, **extra)
    torch.manual_seed(seed)
    model = GPT(config)
    hf = to_hf_model(config, model.state_dict(), tok)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
