"""The data mixture a run trains on, as its console and metrics.jsonl show it: the stages at the start, each
logging interval's realised share of every source (``mix_<source>``), and one line when a source runs out."""

from __future__ import annotations

from dstrain.data.dataset import BlendedDataset, source_names
from dstrain.train.step.components import Component, Progress
from dstrain.train.step.handle import RunHandle


def _weights(names: list[str], weights: list[float]) -> str:
    total = sum(weights)
    return ", ".join(f"{name} {w / total:.3f}" for name, w in zip(names, weights) if w > 0)


def print_stages(recipe, train_data) -> None:
    for line in stage_lines(recipe, train_data):
        print(line, flush=True)


def stage_lines(recipe, train_data) -> list[str]:
    """What the run will sample, stage by stage, and where a capped source runs out (known up front)."""
    if not isinstance(train_data, BlendedDataset):
        return []
    names = source_names([s.path for s in recipe.data.sources])
    starts = recipe.stage_starts()
    lines = []
    for i, (first, weights) in enumerate(starts):
        last = starts[i + 1][0] if i + 1 < len(starts) else recipe.total_steps
        lines.append(f"data mixture, steps {first + 1}-{last}: {_weights(names, weights)}")
    lines += _exhausted(train_data, 0, len(train_data), recipe.train.global_batch, "will run out")
    return lines


def _exhausted(data: BlendedDataset, start: int, end: int, global_batch: int, verb: str) -> list[str]:
    return [
        f"data source {name} {verb} at step {sample // global_batch + 1} (its max_epochs): "
        f"the other sources of the mixture share its weight from there"
        for name, sample in zip(data.names, data.exhausted.tolist())
        if start <= sample < end
    ]


def realised(recipe, train_data, consumed: int, steps: int, announce: bool) -> dict[str, float]:
    """``mix_<source>``: each source's share of the samples of the last ``steps`` steps up to ``consumed``; with
    ``announce``, a line for each source that ran out among them. Nothing for a single source."""
    global_batch = recipe.train.global_batch
    start = consumed - steps * global_batch
    if not isinstance(train_data, BlendedDataset) or steps <= 0:
        return {}
    if announce:
        for line in _exhausted(train_data, start, consumed, global_batch, "ran out"):
            print(line, flush=True)
    return train_data.mix(start, consumed)


class MixtureShares(Component):
    """The mixture's stages printed at the start (rank 0) and each logging interval's realised shares."""

    def __init__(self, recipe, train_data, is_rank0: bool) -> None:
        self.recipe, self.train_data, self.is_rank0 = recipe, train_data, is_rank0

    def on_train_start(self) -> None:
        if self.is_rank0:
            print_stages(self.recipe, self.train_data)

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        return realised(self.recipe, self.train_data, progress.consumed_samples, steps, self.is_rank0)


def build(run: RunHandle) -> MixtureShares:
    return MixtureShares(run.recipe, run.train_data, run.is_rank0)
