"""Tokenizers for ``dstrain prepare``: load a Hugging Face one, or train a byte-level BPE.

Either way the tokenizer is saved next to the shards (``OUT/tokenizer/``) and
identified by a content hash, so the trainer can check that a recipe's tokenizer is
the one the data was made with (``verify_tokenizer``; data folders sharing one: data.manifest.same_tokenizer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from dstrain.data.manifest import Framing, Manifest, same_tokenizer
from dstrain.errors import DstrainError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_DIR = "tokenizer"
BYTE_ALPHABET = 256


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_hub_name(name: str) -> bool:
    """Whether ``name`` can be a Hub model id ("gpt2", "org/name"); "data/x/tokenizer", "./tok", "/abs" cannot."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_tokenizer(name_or_dir: str, flag: str = "--tokenizer"):
    """A fast (Rust-backed) Hugging Face tokenizer with an EOS token, or a one-line DstrainError."""
    from transformers import AutoTokenizer

    if not Path(name_or_dir).exists() and not is_hub_name(name_or_dir):
        raise DstrainError(
            f"tokenizer {name_or_dir} ({flag}): no such folder (relative paths are relative to the working "
            f"directory, {Path.cwd()}); pass the folder's path from here, or an absolute one"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError, KeyError) as e:
        where = "locally (offline: HF_HUB_OFFLINE=1)" if _offline() else "locally or on the Hugging Face Hub"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        no_folder = f"is no folder under {Path.cwd()} and " if "/" in name_or_dir else ""
        raise DstrainError(
            f"tokenizer {name_or_dir!r} ({flag}) {no_folder}could not be found {where}: {reason[:200]}; "
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
        # tokenizers' bars (indicatif) draw on a terminal only; elsewhere (a log, a pipe) each leaves an empty line
        show_progress=show_progress and sys.stderr.isatty(),
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


def document_framing(tokenizer) -> Framing:
    """How `dstrain prepare` frames each document for this tokenizer (the manifest's ``framing``).

    EOS ends every document (all families). BOS starts each one where the tokenizer itself puts it before a text
    (its post-processor adds it: Llama 3's <|begin_of_text|>); a tokenizer that has a BOS token but does not add it
    (GPT-2, Qwen) frames without. A document's ids are then tokenizer(text).input_ids + [EOS]."""
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    return Framing(bos_id=int(bos) if adds_bos else None, eos_id=int(tokenizer.eos_token_id))


def verify_tokenizer(
    manifest: Manifest,
    manifest_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    flag: str = "recipe tokenizer",
) -> None:
    """DstrainError unless ``tokenizer_dir`` is the tokenizer ``manifest_dir``'s data was made with, and framed for."""
    tokenizer = load_tokenizer(str(tokenizer_dir), flag=flag)
    rerun = f"re-run `dstrain prepare --tokenizer {tokenizer_dir}` into a new --out"
    fix = f"use {Path(manifest_dir) / TOKENIZER_DIR} or {rerun}"
    same_tokenizer(manifest, manifest_dir, tokenizer_hash(tokenizer), f"tokenizer {tokenizer_dir} ({flag})", fix)
    framing, recorded = document_framing(tokenizer), manifest.framing
    if framing != recorded:
        raise DstrainError(
            f"{Path(manifest_dir) / 'manifest.json'}: documents were framed as {dataclasses.asdict(recorded)} but "
            f"tokenizer {tokenizer_dir} ({flag}) frames them as {dataclasses.asdict(framing)}; {rerun}"
        )


def run_tokenizer_dir(data) -> Path:
    """The tokenizer a run's data section names: data.tokenizer, else the first source's prepared tokenizer/."""
    return Path(data.sources[0].path) / TOKENIZER_DIR if data.tokenizer is None else Path(data.tokenizer)


def copy_run_tokenizer(data, dest: Path) -> None:
    """At a run's start: the tokenizer of its data into ``dest`` (run_dir/tokenizer), so the run folder alone can be
    exported, evaluated and sampled from. A folder is copied byte for byte; a Hub name is saved from the cache."""
    source = run_tokenizer_dir(data)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if source.is_dir():
        shutil.copytree(source, tmp)
    else:
        load_tokenizer(str(source), flag="data.tokenizer").save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def check_run_tokenizer(run_tokenizer: Path, manifest: Manifest, manifest_dir: str) -> None:
    """On resume: the tokenizer the run started with is the one its data (now) was prepared with."""
    found = tokenizer_hash(load_tokenizer(str(run_tokenizer), flag="the run's tokenizer"))
    fix = "point data.sources at the run's data, or set run_dir=<new folder>"
    same_tokenizer(manifest, manifest_dir, found, f"{run_tokenizer}, the tokenizer this run started with,", fix)


def load_run_tokenizer(run_dir: str | os.PathLike):
    """The run folder's own tokenizer/, copied there at the run's start."""
    from dstrain.run_dir import RunDir

    files = RunDir(Path(run_dir))
    if not files.tokenizer.is_dir():
        raise DstrainError(f"{files.tokenizer}: no such folder; {run_dir} is not a dstrain run, or a damaged one")
    return load_tokenizer(str(files.tokenizer), flag="the run's tokenizer")
