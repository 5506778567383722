"""The scorer the training loop and ``dstrain eval`` share: lm-evaluation-harness's ``loglikelihood`` on our model.

Tokens as lm-eval's ``hf`` model makes them (0.4.13, ``add_bos_token`` unset): the context's trailing spaces move
to the continuation; context + continuation is encoded whole with the tokenizer's own special tokens (the
family's framing: Llama's BOS, none for GPT-2) and the context's tokens are cut off its front; an empty context
is the BOS (else EOS) token; the last ``max_len`` + 1 tokens are kept. The log-likelihood is the sum over the
continuation of log_softmax(logits) in fp32; ``greedy``: every continuation token is the argmax.

Each request is padded on the right to its length rounded up to a multiple of ``BUCKET`` tokens: its shape, and so
its numbers, depend on itself alone, not on the requests beside it in a forward or on the number of replicas. The
requests of one length are split among the data-parallel replicas in a fixed order (the j-th to replica
j mod replicas, ``micro`` per forward; every rank makes the same number of forwards, as ZeRO-3 and the pipeline
need). Each rank that sees the whole result of a forward adds (log-likelihood, misses, 1) to its rows of one
float64 table; one all-reduce over the world gathers it, and the counts undo the model-parallel copies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dstrain.tasks.formats import Item

# forward(input_ids (B, L), targets (B, L), -100 where nothing is scored) -> (B, 2) float64 rows of (log-likelihood,
# continuation tokens that are not the argmax), or None on a rank that does not hold the logits (a pipeline's
# first stages).
Forward = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def prefix_token_id(tokenizer) -> int:
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode(tokenizer, text: str) -> list[int]:
    """lm-eval's tok_encode: the tokenizer's special tokens, unless the text already starts with the prefix token."""
    if text.startswith(tokenizer.decode(prefix_token_id(tokenizer))):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if context == "":
        tokens = tokenizer.encode(continuation, add_special_tokens=False)
        prefix = prefix_token_id(tokenizer)
        return ([prefix], tokens) if prefix != tokens[0] else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_tokens = encode(tokenizer, context)
    return context_tokens, whole[len(context_tokens) :]


def request_rows(tokenizer, items: Sequence[Item], max_len: int) -> list[tuple[list[int], int]]:
    """Per request, in order: (the tokens the model reads, how many of their last positions are scored)."""
    rows = []
    for item in items:
        for context, continuation in item.requests:
            context_tokens, continuation_tokens = encode_pair(tokenizer, context, continuation)
            window = (context_tokens + continuation_tokens)[-(max_len + 1) :]
            rows.append((window, len(continuation_tokens)))
    return rows


def continuation_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, L, V) logits and (B, L) targets -> (B, 2) float64: summed log-probabilities of the targets, and how many
    targets are not the argmax."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    scored = targets != -100
    safe = targets.clamp(min=0)
    picked = log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    misses = (log_probs.argmax(dim=-1) != safe) & scored
    return torch.stack([(picked * scored).double().sum(1), misses.double().sum(1)], dim=1)


def tiled_continuation_stats(
    project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, tiles: int
) -> torch.Tensor:
    """continuation_stats of project(hidden) without the whole logits: the head applied to ``tiles`` sequence chunks
    in turn (the chunked loss's counterpart, dstrain.train.engine.tiling); each row's sums add up over the chunks."""
    step = math.ceil(hidden.shape[1] / tiles)
    chunks = range(0, hidden.shape[1], step)
    return torch.stack(
        [continuation_stats(project(hidden[:, i : i + step]), targets[:, i : i + step]) for i in chunks]
    ).sum(0)


@dataclass
class PreparedTask:
    """A task's items and their requests' rows, tokenized once for every evaluation of a run."""

    name: str
    items: list[Item]
    rows: list[tuple[list[int], int]]


def prepare(tasks: Sequence[tuple[str, list[Item]]], tokenizer, max_len: int) -> list[PreparedTask]:
    return [PreparedTask(name, items, request_rows(tokenizer, items, max_len)) for name, items in tasks]


@dataclass
class Layout:
    """How the scorer's forwards are spread: ``replica`` of ``replicas`` data-parallel replicas, ``micro`` requests
    per forward, lengths a multiple of ``multiple_of`` (the sequence-parallel size) within ``max_len`` tokens."""

    replica: int
    replicas: int
    micro: int
    max_len: int
    device: torch.device
    multiple_of: int = 1


BUCKET = 32  # tokens: a request costs at most BUCKET - 1 padded positions


def lengths(rows, layout: Layout) -> dict[int, list[int]]:
    """{padded length: the indices of its requests}, shortest first; lengths are multiples of ``multiple_of`` (the
    sequence-parallel size) within ``max_len`` (a longer request keeps its last tokens, as lm-eval's does)."""
    step = math.ceil(BUCKET / layout.multiple_of) * layout.multiple_of
    limit = layout.max_len - layout.max_len % layout.multiple_of
    groups: dict[int, list[int]] = {}
    for index, (tokens, _) in enumerate(rows):
        groups.setdefault(min(math.ceil((len(tokens) - 1) / step) * step, limit), []).append(index)
    return dict(sorted(groups.items()))


def batch_of(rows, indices: Sequence[int], length: int, micro: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``micro`` rows (the last chunk filled with unscored rows: every forward has one shape,
    which the pipeline's buffers need)."""
    inputs = torch.zeros(micro, length, dtype=torch.long)
    targets = torch.full((micro, length), -100, dtype=torch.long)
    for row, index in enumerate(indices):
        tokens, scored = rows[index]
        tokens = tokens[-(length + 1) :]
        n = len(tokens) - 1
        scored = min(scored, n)
        inputs[row, :n] = torch.tensor(tokens[:-1])
        targets[row, n - scored : n] = torch.tensor(tokens[n - scored + 1 :])
    return inputs.to(device), targets.to(device)


def score(rows, forward: Forward, layout: Layout, new_length=None) -> tuple[list[float], list[bool]]:
    """(log-likelihoods, greedy flags) of every request, on every rank; a collective over the default group.
    ``new_length()`` runs before the forwards of each padded length (the pipeline resets its buffers)."""
    table = torch.zeros(len(rows), 3, dtype=torch.float64, device=layout.device)
    for length, requests in lengths(rows, layout).items():
        if new_length is not None:
            new_length()
        mine = requests[layout.replica :: layout.replicas]
        chunks = [mine[start : start + layout.micro] for start in range(0, len(mine), layout.micro)]
        calls = math.ceil(math.ceil(len(requests) / layout.replicas) / layout.micro)
        for call in range(calls):
            indices = chunks[min(call, len(chunks) - 1)] if chunks else requests[:1]
            stats = forward(*batch_of(rows, indices, length, layout.micro, layout.device))
            if stats is not None and call < len(chunks):
                table[indices, :2] += stats[: len(indices)].to(table.dtype)
                table[indices, 2] += 1
    torch.distributed.all_reduce(table)
    table = table.cpu()
    return (table[:, 0] / table[:, 2]).tolist(), (table[:, 1] == 0).tolist()


@torch.no_grad()
def evaluate(tasks: Sequence[PreparedTask], forward: Forward, layout: Layout, new_length=None) -> dict:
    """Every task's metrics (``task/<name>/...``) and the seconds they took (``tasks_s``)."""
    start = time.perf_counter()
    metrics: dict = {}
    for task in tasks:
        lls, greedy = score(task.rows, forward, layout, new_length)
        metrics.update(task_metrics(task.name, task.items, lls, greedy))
    return {**metrics, "tasks_s": time.perf_counter() - start}


def task_metrics(name: str, items: Sequence[Item], lls: Sequence[float], greedy: Sequence[bool]) -> dict:
    """lm-eval's process_results: acc = argmax(lls) is the gold (first maximum wins), acc_norm = argmax(lls /
    characters of each choice); a greedy item: acc = its continuation is the argmax."""
    right = right_norm = 0
    start = 0
    for item in items:
        n = len(item.requests)
        item_lls = np.array(lls[start : start + n])
        if item.kind == "greedy":
            right += int(greedy[start])
        else:
            right += int(np.argmax(item_lls) == item.gold)
            lengths = np.array([float(len(choice)) for choice in item.choices])
            right_norm += int(np.argmax(item_lls / lengths) == item.gold)
        start += n
    metrics = {f"task/{name}/acc": right / len(items)}
    if all(item.normalised for item in items):
        metrics[f"task/{name}/acc_norm"] = right_norm / len(items)
    return {**metrics, f"task/{name}/samples": len(items)}
