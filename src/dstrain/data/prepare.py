"""Tokenize a dataset into Megatron MMIDIDX shards plus ``manifest.json`` (the work of ``dstrain prepare``).

OUT/
  tokenizer/             the tokenizer, loadable with AutoTokenizer.from_pretrained
  prepare_inputs.json    what this folder is being made from (checked on every re-run)
  shard_00000.bin/.idx   documents [0, n0), at most --shard-tokens tokens (EOS included)
  shard_00001.bin/.idx   documents [n0, n0+n1), ...
  manifest.json          written last: its presence means every shard is complete

Shard k starts where shard k-1 ends and closes before the first document that would
overflow it, so shard boundaries depend only on the inputs. A re-run with the same
inputs keeps every complete shard and writes only the missing ones.

As one of N tasks (``--num-tasks``, or a Slurm array), the same happens in
``OUT/tasks/<i>-of-<N>/`` for the task's part of the input; prepare_parts.py splits and merges.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dstrain.data import prepare_parts
from dstrain.data.chat import ChatEncoder, has_generation_markers, load_chat_template, template_hash
from dstrain.data.encode import ParallelEncoder
from dstrain.data.manifest import (
    FORMAT,
    FORMAT_VERSION,
    INPUTS_NAME,
    MANIFEST_NAME,
    ChatRecord,
    Manifest,
    PairsRecord,
    ShardRecord,
    SourceRecord,
    TaskRecord,
    TokenizerRecord,
    read_manifest,
    shard_files,
    write_manifest,
)
from dstrain.data.pairs import PairEncoder, pair_counts
from dstrain.data.shard_writing import Progress, chat_counts, complete_shard, write_shards
from dstrain.data.shards import token_dtype
from dstrain.data.sources import PAIR_FORMAT, Source, SourceSpec, describe, open_chat_source, open_source, text_batches
from dstrain.data.tokenizer import (
    TOKENIZER_DIR,
    document_framing,
    load_tokenizer,
    save_tokenizer,
    tokenizer_hash,
    train_bpe_tokenizer,
    verify_tokenizer,
)
from dstrain.errors import DstrainError
from dstrain.files import write_json_atomic

DEFAULT_SHARD_TOKENS = 100_000_000
BATCH_DOCS = 1000  # documents per tokenisation task: large enough to amortise IPC, small in memory

__all__ = ["DEFAULT_SHARD_TOKENS", "PrepareOptions", "prepare", "run", "verify_tokenizer"]


@dataclass
class PrepareOptions:
    """Every option of ``dstrain prepare`` (the CLI flags, by the same names)."""

    dataset: str  # Hub id, save_to_disk folder, data folder, or data file(s)/glob
    out: str  # output folder for shards, tokenizer and manifest
    tokenizer: str | None = None  # Hugging Face tokenizer name or folder (fast tokenizers only)
    train_tokenizer: int | None = None  # or: train a byte-level BPE of this vocabulary size on the data
    dataset_config: str | None = None  # dataset configuration name
    split: str = "train"  # split to tokenize
    text_field: str = "text"  # column with each document's text
    streaming: bool = False  # read the dataset as a stream (no full download/Arrow conversion first)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # upper bound on tokens per shard (unless one document is longer)
    num_proc: int | None = None  # tokenizer processes; None = every core this process may use
    progress: bool = True  # show a progress bar on stderr
    num_tasks: int | None = None  # prepare as one of this many tasks (default: SLURM_ARRAY_TASK_COUNT, else 1)
    task_index: int | None = None  # this task's index in [0, num_tasks) (default: SLURM_ARRAY_TASK_ID)
    chat: bool = False  # conversations (messages, or prompt/completion) rendered by a chat template, with a loss mask
    chat_template: str | None = None  # --chat: a Jinja template file used instead of the tokenizer's own

    def command(self) -> str:
        """The equivalent one-process command line, recorded in the manifest (tasks make the same data)."""
        parts = ["dstrain", "prepare", "--dataset", self.dataset, "--out", self.out]
        if self.tokenizer is not None:
            parts += ["--tokenizer", self.tokenizer]
        if self.train_tokenizer is not None:
            parts += ["--train-tokenizer", str(self.train_tokenizer)]
        if self.dataset_config is not None:
            parts += ["--dataset-config", self.dataset_config]
        parts += ["--split", self.split, "--text-field", self.text_field, "--shard-tokens", str(self.shard_tokens)]
        if self.chat:
            parts += ["--chat"] + (["--chat-template", self.chat_template] if self.chat_template else [])
        return shlex.join(parts + (["--streaming"] if self.streaming else []))


def prepare(dataset: str, out: str, **options) -> Manifest:
    """Python entry point: ``options`` are PrepareOptions' other fields, as the CLI's flags; returns the manifest."""
    return run(PrepareOptions(dataset=str(dataset), out=str(out), **options))


INPUT_KEYS = ("source", "tokenizer", "shard_tokens")  # what prepare_inputs.json and manifest.json both hold


def _existing_inputs(out: Path) -> dict | None:
    """What an earlier run made ``out`` from; None for a new or empty folder."""
    if not out.exists() or not any(out.iterdir()):
        return None
    if not out.is_dir():
        raise DstrainError(f"--out {out} is a file; choose a folder path for --out")
    for name in (INPUTS_NAME, MANIFEST_NAME):
        if (out / name).is_file():
            try:
                record = json.loads((out / name).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or any(key not in record for key in INPUT_KEYS):
                raise DstrainError(f"{out / name}: unreadable; choose another --out (nothing was changed)")
            return record
    raise DstrainError(
        f"--out {out} is not empty and holds no `dstrain prepare` output; choose another --out (nothing was changed)"
    )


def _conflict(existing: dict, inputs: dict) -> str | None:
    """How ``existing`` inputs differ from this run's, or None if this run may continue them."""
    old_src, new_src = existing["source"], inputs["source"]
    if old_src["fingerprint"] != new_src["fingerprint"]:
        return f"a different dataset ({old_src['dataset']}, content fingerprint {old_src['fingerprint']})"
    for key, flag in (("split", "--split"), ("config", "--dataset-config"), ("text_field", "--text-field")):
        if old_src[key] != new_src[key]:
            return f"{flag} {old_src[key]!r}"
    old_tok, new_tok = existing["tokenizer"], inputs["tokenizer"]
    if old_tok["trained_vocab_size"] != new_tok["trained_vocab_size"]:
        old = old_tok["trained_vocab_size"]
        return f"--train-tokenizer {old}" if old else f"--tokenizer {old_tok['name']!r}"
    if new_tok["hash"] is not None and old_tok["hash"] != new_tok["hash"]:
        return f"a different tokenizer ({old_tok['name']!r}, hash {old_tok['hash']})"
    if existing["shard_tokens"] != inputs["shard_tokens"]:
        return f"--shard-tokens {existing['shard_tokens']}"
    old_chat, new_chat = existing.get("chat"), inputs.get("chat")  # present for --chat only
    if old_chat is None and new_chat is None:
        return None
    if old_chat is None or new_chat is None:
        return "text (without --chat)" if old_chat is None else "conversations (--chat)"
    if new_chat["template_hash"] != old_chat["template_hash"]:
        return f"another chat template (hash {old_chat['template_hash']})"
    return None


def _refuse(out: Path, what: str) -> DstrainError:
    return DstrainError(
        f"--out {out} already holds data prepared from {what}; choose another --out (nothing was changed)"
    )


def _complete_manifest(out: Path) -> Manifest | None:
    """The manifest of a finished prepare in ``out`` whose every shard is whole; None otherwise."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = read_manifest(out)
    except DstrainError:
        return None  # rewritten at the end of this run
    if all(complete_shard(out, i, manifest.masked) is not None for i in range(len(manifest.shards))):
        return manifest
    return None


def _check_out(out: Path) -> None:
    blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == out else f"is under {blocker}, a file"
        raise DstrainError(f"--out {out} {where}; name a new or existing folder")


def _check_options(opts: PrepareOptions) -> None:
    if (opts.tokenizer is None) == (opts.train_tokenizer is None):
        raise DstrainError(
            "dstrain prepare: pass exactly one of --tokenizer NAME_OR_DIR or --train-tokenizer VOCAB_SIZE"
        )
    if opts.shard_tokens < 1:
        raise DstrainError(f"--shard-tokens {opts.shard_tokens}: must be a positive number of tokens, e.g. 100000000")
    if opts.chat and opts.tokenizer is None:
        raise DstrainError(
            "dstrain prepare --chat: pass --tokenizer (the model's tokenizer folder, whose chat template renders the "
            "conversations); --train-tokenizer makes a tokenizer without one"
        )
    if opts.chat_template is not None and not opts.chat:
        raise DstrainError("dstrain prepare: --chat-template renders conversations; add --chat")
    if opts.num_proc is not None and opts.num_proc < 1:
        raise DstrainError(f"--num-proc {opts.num_proc}: must be at least 1 (or left out: every core)")
    _check_out(Path(opts.out))


@dataclass(frozen=True)
class HashedTokenizer:
    """A tokenizer with its hash (dstrain.data.tokenizer.tokenizer_hash), taken once: a prepare hashes the tokenizer
    it uses once, and the copy an interrupted run saved at most once."""

    tokenizer: Any
    hash: str

    @classmethod
    def of(cls, tokenizer) -> HashedTokenizer:
        return cls(tokenizer, tokenizer_hash(tokenizer))

    @classmethod
    def loaded(cls, name_or_dir: str) -> HashedTokenizer:
        return cls.of(load_tokenizer(name_or_dir))


def _trained_tokenizer(
    opts: PrepareOptions, source, saved: HashedTokenizer | None, earlier_hash: str | None
) -> HashedTokenizer:
    """--train-tokenizer: the one an interrupted run trained and saved if it is there, else train one."""
    if earlier_hash and saved is not None and saved.hash == earlier_hash:
        return saved
    assert opts.train_tokenizer is not None  # _check_options: --tokenizer or --train-tokenizer
    trained = HashedTokenizer.of(
        train_bpe_tokenizer(text_batches(source, 0, BATCH_DOCS), opts.train_tokenizer, source.num_docs, opts.progress)
    )
    if earlier_hash and trained.hash != earlier_hash:
        raise _refuse(
            Path(opts.out), f"a tokenizer trained earlier (hash {earlier_hash}) that retraining did not reproduce"
        )
    return trained


def run(opts: PrepareOptions) -> Manifest:
    """Prepare ``opts.dataset`` into ``opts.out``; as one of N tasks, only this task's part (see prepare_parts.py),
    merged by the task that finishes last. Returns the manifest written (the task's part, or the merged one)."""
    _check_options(opts)
    slot = prepare_parts.task_slot(opts.num_tasks, opts.task_index, os.environ)
    if slot is not None and opts.train_tokenizer is not None:
        raise DstrainError(
            f"--train-tokenizer with {slot.count} tasks: each task would train its own tokenizer; "
            f"train one first (a one-process prepare of a sample) and pass it with --tokenizer"
        )
    if not opts.progress:
        import datasets

        datasets.disable_progress_bars()
    spec = SourceSpec(opts.dataset, opts.dataset_config, opts.split, opts.text_field, opts.streaming)
    given = HashedTokenizer.loaded(opts.tokenizer) if opts.tokenizer is not None else None  # hashed once
    if slot is None:
        source = open_chat_source(spec)[0] if opts.chat else open_source(spec)
        return _prepare_folder(Path(opts.out), opts, given, source, {})
    out = Path(opts.out)
    if (merged := _complete_manifest(out)) is not None:
        if (conflict := _conflict_ignoring_fingerprint(merged, spec, opts, given)) is not None:
            raise _refuse(out, conflict)
        return (
            prepare_parts.merge(out) if (out / prepare_parts.TASKS_DIR).exists() else merged
        )  # a merge cut short: finish it
    prepare_parts.check_layout(out, slot)
    source, record = prepare_parts.open_part(spec, slot, opts.chat)
    part = _prepare_folder(prepare_parts.task_folder(out, slot), opts, given, source, {"task": record})
    prepare_parts.merge_if_last(out, slot.count)
    return part


def _conflict_ignoring_fingerprint(
    manifest: Manifest, spec: SourceSpec, opts: PrepareOptions, given: HashedTokenizer | None
) -> str | None:
    """How a merged folder's inputs differ from a task's options (its content fingerprint is not recomputed)."""
    recorded = manifest.to_dict()  # its inputs, as prepare_inputs.json records them
    inputs = {
        "source": {**describe(spec), "fingerprint": manifest.source.fingerprint},
        "tokenizer": {
            **dataclasses.asdict(manifest.tokenizer),
            "hash": given.hash if given is not None else None,
            "trained_vocab_size": opts.train_tokenizer,
        },
        "shard_tokens": opts.shard_tokens,
    }
    if opts.chat:  # whether the folder holds conversations (its template is not rendered again)
        inputs["chat"] = (
            dataclasses.asdict(manifest.chat) if manifest.chat else {}
        )  # {} where the folder holds text: the conflict then says so
    return _conflict(recorded, inputs)


def _prepare_folder(
    out: Path, opts: PrepareOptions, given: HashedTokenizer | None, source: Source, extra_inputs: dict
) -> Manifest:
    """Prepare ``source`` into ``out`` (a whole prepare, or one task's folder) with the ``given`` tokenizer (None:
    --train-tokenizer); resumes what is there."""
    spec = source.spec
    inputs: dict[str, Any] = {
        "source": {**describe(spec), "fingerprint": source.fingerprint},
        "tokenizer": {
            "name": opts.tokenizer if given is not None else f"byte-level BPE trained on {spec.dataset}",
            "path": TOKENIZER_DIR,
            "hash": given.hash if given is not None else None,
            "trained_vocab_size": opts.train_tokenizer,
        },
        "shard_tokens": opts.shard_tokens,
        **extra_inputs,
    }
    if opts.chat:  # only then: the manifests of text (and their hashes, which key caches and checkpoints) unchanged
        inputs["chat"] = _chat_inputs(opts, given.tokenizer if given is not None else None, source)
    existing = _existing_inputs(out)
    if existing is not None and (conflict := _conflict(existing, inputs)):
        raise _refuse(out, conflict)
    if existing is not None and (done := _complete_manifest(out)) is not None:
        return done

    tokenizer_dir = out / TOKENIZER_DIR
    saved = HashedTokenizer.loaded(str(tokenizer_dir)) if tokenizer_dir.is_dir() else None
    if given is None:
        given = _trained_tokenizer(opts, source, saved, existing["tokenizer"]["hash"] if existing else None)
        inputs["tokenizer"]["hash"] = given.hash
    tokenizer = given.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    if opts.chat:  # the template the data was rendered with travels with the tokenizer
        tokenizer.chat_template = load_chat_template(tokenizer, opts.chat_template, str(opts.tokenizer))
    stale = saved is None or saved.hash != given.hash
    if stale or getattr(saved and saved.tokenizer, "chat_template", None) != getattr(tokenizer, "chat_template", None):
        save_tokenizer(tokenizer, tokenizer_dir)
    write_json_atomic(out / INPUTS_NAME, inputs)
    shards, dtype = _tokenize(out, source, tokenizer, opts)
    return write_manifest(out, _manifest(out, opts, inputs, tokenizer, shards, dtype, source.chat_format))


def _manifest(
    out: Path, opts: PrepareOptions, inputs: dict, tokenizer, shards: list[dict], dtype: np.dtype, chat_format
) -> Manifest:
    """The typed manifest of the shards written into ``out`` from ``inputs`` (prepare_inputs.json's record)."""
    records = [ShardRecord(**shard, **shard_files(out / shard["prefix"])) for shard in shards]
    prefixes = [s.prefix for s in records]
    pairs = chat_format == PAIR_FORMAT  # only then a pairs record: the conversations' manifests (hashes) unchanged
    return Manifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        tokenizer=TokenizerRecord(**inputs["tokenizer"]),
        vocab_size=len(tokenizer),
        eos_id=int(tokenizer.eos_token_id),
        framing=document_framing(tokenizer),
        dtype=dtype.name,
        shards=records,
        documents=sum(s.documents for s in records),
        tokens=sum(s.tokens for s in records),
        shard_tokens=opts.shard_tokens,
        source=SourceRecord(**inputs["source"]),
        command=opts.command(),
        chat=ChatRecord(**inputs["chat"], **chat_counts(out, prefixes)) if opts.chat else None,
        pairs=PairsRecord(**pair_counts(out, prefixes)) if pairs else None,
        task=TaskRecord(**inputs["task"]) if "task" in inputs else None,
    )


def _tokenize(out: Path, source, tokenizer, opts: PrepareOptions) -> tuple[list[dict], np.dtype]:
    """Every document into shards (the complete ones of an interrupted run kept); (shard records, token dtype)."""
    dtype = token_dtype(len(tokenizer))
    num_proc = opts.num_proc or len(os.sched_getaffinity(0))
    encoder: ParallelEncoder | ChatEncoder = ParallelEncoder.for_tokenizer(tokenizer, dtype, num_proc)
    if source.chat_format is not None:
        chat_encoder = PairEncoder if source.chat_format == PAIR_FORMAT else ChatEncoder
        encoder = chat_encoder(tokenizer, tokenizer.chat_template, source.chat_format, dtype)
        if source.num_docs is not None:  # bad examples refused before the first shard is written
            encoder.check(source)
    progress = Progress(source.num_docs or source.announced_docs, opts.progress)
    try:
        shards = write_shards(out, source, encoder, dtype, opts.shard_tokens, progress)
    finally:
        progress.bar.close()
    for stale in out.glob("shard_*.tmp"):  # masks' too: shard_*.mask.bin.tmp
        stale.unlink()
    return shards, dtype


def _chat_inputs(opts: PrepareOptions, tokenizer, source: Source) -> dict:
    """What a --chat folder is rendered with: the example format, the template's hash, where its mask comes from."""
    template = load_chat_template(tokenizer, opts.chat_template, str(opts.tokenizer))
    markers = has_generation_markers(template)
    return {
        "format": source.chat_format,
        "template_hash": template_hash(template),
        "template_file": opts.chat_template,
        "mask_from": "generation markers" if markers else "prefix renders, checked against each assistant content",
    }
