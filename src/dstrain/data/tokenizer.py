"""Tokenizers for ``dstrain prepare``: load a Hugging Face one, or train a byte-level BPE.

Either way the tokenizer is saved next to the shards (``OUT/tokenizer/``) and
identified by a content hash, so the trainer can check that a recipe's tokenizer is
the one the data was made with (``verify_tokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from dstrain.data.manifest import read_manifest
from dstrain.errors import DstrainError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_DIR = "tokenizer"
BYTE_ALPHABET = 256


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_tokenizer(name_or_dir: str, flag: str = "--tokenizer"):
    """A fast (Rust-backed) Hugging Face tokenizer with an EOS token, or a one-line DstrainError."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError, KeyError) as e:
        where = "locally (offline: HF_HUB_OFFLINE=1)" if _offline() else "locally or on the Hugging Face Hub"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DstrainError(
            f"tokenizer {name_or_dir!r} ({flag}) could not be found {where}: {reason[:200]}; "
            f"pass a local tokenizer folder, download it first (`hf download {name_or_dir}`), or use --train-tokenizer"
        ) from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise DstrainError(
            f"tokenizer {name_or_dir!r} ({flag}) has no fast (Rust) backend; convert it with "
            f"transformers' convert_slow_tokenizer or pick a tokenizer that ships a tokenizer.json"
        )
    if tokenizer.eos_token_id is None:
        raise DstrainError(
            f"tokenizer {name_or_dir!r} ({flag}) has no EOS token (eos_token), so documents could not be "
            f"separated; pick a tokenizer with one or use --train-tokenizer"
        )
    return tokenizer


def train_bpe_tokenizer(
    text_batches: Iterator[list[str]], vocab_size: int, num_docs: int | None, show_progress: bool = False
):
    """Train a GPT-2-style byte-level BPE with ``<|endoftext|>`` as EOS (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= BYTE_ALPHABET:
        raise DstrainError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs more than {BYTE_ALPHABET} "
            f"entries (256 bytes + EOS); pass e.g. --train-tokenizer 32000"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(text_batches, trainer, length=num_docs)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False)


def tokenizer_hash(tokenizer) -> str:
    """Hash of what maps text to ids: normalizer, pre-tokenizer, model, added tokens, EOS.

    The post-processor, decoder, padding and truncation are left out: they do not change
    the ids prepare writes, and transformers rewrites some of them when it loads a tokenizer.
    """
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    content = {key: spec.get(key) for key in ("normalizer", "pre_tokenizer", "model", "added_tokens")}
    content["eos_token"] = tokenizer.eos_token
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Save so that ``AutoTokenizer.from_pretrained(folder)`` loads it; replaces ``folder`` whole."""
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def document_framing(tokenizer) -> dict[str, int | None]:
    """How `dstrain prepare` frames each document for this tokenizer: {"bos_id", "eos_id"}.

    EOS ends every document (all families). BOS starts each one where the tokenizer itself puts it before a text
    (its post-processor adds it: Llama 3's <|begin_of_text|>); a tokenizer that has a BOS token but does not add it
    (GPT-2, Qwen) frames without. A document's ids are then tokenizer(text).input_ids + [EOS]."""
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    return {"bos_id": int(bos) if adds_bos else None, "eos_id": int(tokenizer.eos_token_id)}


def manifest_framing(manifest: dict) -> dict[str, int | None]:
    """The framing a manifest records; folders prepared before it was recorded framed with EOS only."""
    return manifest.get("framing") or {"bos_id": None, "eos_id": manifest["eos_id"]}


def verify_tokenizer(
    manifest_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, flag: str = "recipe tokenizer"
) -> None:
    """DstrainError unless ``tokenizer_dir`` is the tokenizer ``manifest_dir``'s data was made with, and framed for."""
    manifest = read_manifest(manifest_dir)
    expected = manifest["tokenizer"]["hash"]
    tokenizer = load_tokenizer(str(tokenizer_dir), flag=flag)
    actual = tokenizer_hash(tokenizer)
    fix = f"re-run `dstrain prepare --tokenizer {tokenizer_dir}` into a new --out"
    if actual != expected:
        raise DstrainError(
            f"tokenizer {tokenizer_dir} ({flag}, hash {actual}) is not the one {manifest_dir} was prepared with "
            f"(manifest.json tokenizer.hash {expected}); use {Path(manifest_dir) / TOKENIZER_DIR} or {fix}"
        )
    framing, recorded = document_framing(tokenizer), manifest_framing(manifest)
    if framing != recorded:
        raise DstrainError(
            f"{Path(manifest_dir) / 'manifest.json'}: documents were framed as {recorded} but tokenizer "
            f"{tokenizer_dir} ({flag}) frames them as {framing}; {fix}"
        )


def run_tokenizer_dir(data) -> Path:
    """The tokenizer a run's data section names: data.tokenizer, else the first source's prepared tokenizer/."""
    return Path(data.tokenizer or Path(data.sources[0].path) / TOKENIZER_DIR)


def load_run_tokenizer(data):
    return load_tokenizer(str(run_tokenizer_dir(data)), flag="the run's tokenizer")
