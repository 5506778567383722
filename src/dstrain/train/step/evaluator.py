"""The one evaluation of a model: the token-weighted mean loss of each valid source and the downstream tasks' scores,
driven through dstrain.train.step.forward.ModelForward, so the trainer (under every strategy: ZeRO, AutoTP, pipeline,
sequence parallelism) and ``dstrain eval`` (a plain model, ``ModelForward.of_module``) compute the same numbers.

Each data-parallel replica takes every ``replicas``-th sample; the micro-batches' (loss x tokens, tokens) are summed
in float64 over all ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dstrain.metrics_records import SourceLoss
from dstrain.tasks import scoring
from dstrain.train.step.forward import ModelForward


@dataclass(frozen=True)
class SourceEval:
    loss: SourceLoss
    tokens: int  # the tokens its loss averaged over


class Evaluator:
    def __init__(self, runner: ModelForward, replica: int, replicas: int, micro: int, max_len: int) -> None:
        """``replica`` of ``replicas``: this rank's data-parallel rank and their number; ``micro``: samples per
        forward; ``max_len``: the model's positions (the longest task row)."""
        self.runner, self.replica, self.replicas, self.micro = runner, replica, replicas, micro
        self.task_layout = scoring.Layout(
            replica=replica, replicas=replicas, micro=micro, max_len=max_len, device=runner.device,
            multiple_of=runner.sp_size,
        )  # fmt: skip

    def sources(self, valid_sets, samples: int | None) -> list[SourceEval]:
        """Each (name, weight, data) of ``valid_sets`` over its first ``samples`` samples (None: all); a collective."""
        evals = []
        for name, weight, data in valid_sets:
            n = len(data) if samples is None else min(len(data), samples)
            loss, tokens = self.mean_loss(data, n)
            evals.append(SourceEval(SourceLoss(name, weight, loss, n), tokens))
        return evals

    @torch.no_grad()
    def mean_loss(self, data, n: int) -> tuple[float, int]:
        """Token-weighted mean loss over the first ``n`` samples of ``data``, and the tokens it counted."""
        mine = list(range(self.replica, n, self.replicas))
        sums = torch.zeros(2, device=self.runner.device, dtype=torch.float64)  # loss x tokens, tokens
        micro = self.micro
        chunks = [mine[start : start + micro] for start in range(0, len(mine), micro)]
        # Every rank makes the same number of forward calls (ZeRO-3 gathers and the pipeline's eval_batch barrier
        # are collectives); a replica with fewer samples repeats its last chunk and ignores the result.
        calls = math.ceil(math.ceil(n / self.replicas) / micro)
        for i in range(calls):
            batch = self.runner.to_device(chunks[min(i, len(chunks) - 1)] if chunks else [0], data)
            loss = self.runner.eval_loss(batch)
            if loss is not None and i < len(chunks):
                sums += self.runner.eval_sums(loss, int((batch["labels"] != -100).sum()))  # learned tokens
        # Model-parallel replicas add equal shares to both sums (TP), or only the last stage adds (pipeline).
        torch.distributed.all_reduce(sums)
        return (sums[0] / sums[1]).item(), int(sums[1].item())

    def end(self) -> None:
        """After the valid sets: the engine as training needs it again."""
        self.runner.end_eval()

    @torch.no_grad()
    def tasks(self, tasks: list[scoring.PreparedTask]) -> dict:
        """``task/<name>/acc``, ``acc_norm``, ``samples`` of every task, and ``tasks_s``; a collective."""
        reset = self.runner.new_score_length()
        try:
            return scoring.evaluate(tasks, self.runner.score, self.task_layout, new_length=reset)
        finally:
            if reset is not None:
                reset()  # the next train_batch sends its own shapes again
