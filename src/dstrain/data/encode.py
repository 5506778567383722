"""Parallel tokenisation for ``dstrain prepare``: text batches in, packed id arrays out, in order.

Workers hold only a ``tokenizers.Tokenizer`` (not transformers, not datasets), so they
start in a fraction of a second. We use our own bounded process pool rather than
``datasets.map(num_proc=...)`` because map materialises every token id in an Arrow
cache (a second copy of the corpus on disk) and does not parallelise streaming datasets;
and rather than ``multiprocessing.Pool.imap`` because its feeder thread reads the whole
input ahead, so memory would grow with the corpus.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np
from tokenizers import Tokenizer

_worker: dict = {}


def init_encoder(tokenizer_json: str, eos_id: int, dtype: str, threads: bool, bos_id: int | None = None) -> None:
    """Load the tokenizer once per process. ``threads``: let the Rust side use every core. ``bos_id``: the token
    that starts every document, where the tokenizer puts one (dstrain.data.tokenizer.document_framing)."""
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one single-threaded worker per core
    tokenizer = Tokenizer.from_str(tokenizer_json)
    # A document that quotes "<|endoftext|>" must not become two documents: special tokens
    # written in the text are tokenized as plain text; only the appended EOS is special.
    tokenizer.encode_special_tokens = True
    _worker.update(tokenizer=tokenizer, eos_id=eos_id, dtype=np.dtype(dtype), bos=[] if bos_id is None else [bos_id])


def encode_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of every text framed as its family frames it (BOS first where the tokenizer puts one, EOS
    appended), back to back, and each document's size."""
    encodings = _worker["tokenizer"].encode_batch_fast(texts, add_special_tokens=False)
    id_lists = [_worker["bos"] + e.ids for e in encodings]
    sizes = np.fromiter((len(ids) + 1 for ids in id_lists), dtype=np.int64, count=len(id_lists))
    ends = np.cumsum(sizes)
    flat = np.empty(int(ends[-1]) if sizes.size else 0, dtype=_worker["dtype"])
    flat[ends - 1] = _worker["eos_id"]
    for ids, end in zip(id_lists, ends):
        flat[end - 1 - len(ids) : end - 1] = ids
    return flat, sizes


class ParallelEncoder:
    """``encode(batches)`` yields ``encode_texts(batch)`` for each batch, in input order; ``read(source, start)``
    the same of a source's documents from ``start`` on, with no loss mask (dstrain.data.shard_writing).

    With ``num_proc > 1`` batches go to a pool of ``num_proc`` processes with at most
    ``2 * num_proc`` in flight, so memory stays bounded whatever the corpus size.
    """

    masked = False  # every token is learned: no loss mask is written
    batch_docs = 1000  # documents per tokenisation task: large enough to amortise IPC, small in memory

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: np.dtype, num_proc: int, bos_id: int | None = None):
        self.num_proc = num_proc
        self._init_args = (tokenizer_json, int(eos_id), np.dtype(dtype).str)
        self._bos_id = bos_id
        self._pool: ProcessPoolExecutor | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer, dtype: np.dtype, num_proc: int) -> ParallelEncoder:
        """An encoder framing documents as `tokenizer`'s family does (dstrain.data.tokenizer.document_framing)."""
        from dstrain.data.tokenizer import document_framing

        framing = document_framing(tokenizer)
        return cls(tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, dtype, num_proc, framing.bos_id)

    def __enter__(self) -> ParallelEncoder:
        if self.num_proc > 1:
            # forkserver, not fork: the parent holds datasets/arrow threads and maybe a used
            # Rust thread pool, which a forked child could inherit mid-lock.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            self._pool = ProcessPoolExecutor(
                self.num_proc,
                mp_context=context,
                initializer=init_encoder,
                initargs=(*self._init_args, False, self._bos_id),
            )
        else:
            init_encoder(*self._init_args, True, self._bos_id)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def read(self, source, start: int) -> Iterator[tuple[np.ndarray, np.ndarray, None]]:
        from dstrain.data.sources import text_batches

        for ids, sizes in self.encode(text_batches(source, start, self.batch_docs)):
            yield ids, sizes, None

    def encode(self, text_batches: Iterable[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self._pool is None:
            for texts in text_batches:
                yield encode_texts(texts)
            return
        pending: deque[Future] = deque()
        try:
            for texts in text_batches:
                pending.append(self._pool.submit(encode_texts, texts))
                if len(pending) >= 2 * self.num_proc:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # the caller stopped early: drop what is still queued
            for future in pending:
                future.cancel()
