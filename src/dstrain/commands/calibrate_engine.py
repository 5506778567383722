"""What DeepSpeed's engines cost beyond the bare model's forward and backward, measured on this machine by building
and stepping them, for `dstrain compare --plan`.

The bare-model calibration (dstrain.plan.calibrate) sees none of the engine's own time: ZeRO's gradient hooks and
bucketing, ZeRO-3's gathers and releases per module, the pipeline engine's instruction loop, the optimizer step.
On 2 CPU ranks that time is most of a small model's step (BENCHMARKS.md: ~1 s per ZeRO-3 micro-batch against a
0-19 ms bare fixed cost). Here each engine kind (ZeRO-0..3 without model parallelism, a 2-stage pipeline) runs the
recipe's model on ``ranks`` gloo ranks at micro-batches of one sample, with 4 and then 8 micro-batches per step
(``set_train_batch_size``); whatever the time model does not predict of each step is split into a cost per
micro-batch and a cost per step, and the calibrated Device adds both to the prediction.

A TP or SP group costs more than its collectives' bytes: a call's latency (a small gloo all-reduce takes ~1 ms
here), AutoTP's and Ulysses' copies, which grow with the micro-batch. So a TP group of 2 (ZeRO-1) and an SP group of
2 (ZeRO-0) run 4 micro-batches of 1 and then 4 samples; what is left after the time model and their ZeRO stage's
engine cost becomes a cost per micro-batch and per sample of it (Device.parallel_costs), added to every layout
with such a group. Measured on 2 ranks, the planner's TP2 prediction was 1.46x short without it (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time

from dstrain.config import Recipe
from dstrain.plan.time_model import Cluster, Device, predict

ACCUMULATIONS = (4, 8)  # micro-batches per step of the engine kinds, at micro-batches of one sample
PARALLEL_MICROS = (1, 4)  # samples per micro-batch of the TP and SP kinds, at ACCUMULATIONS[0] micro-batches
TIMED_STEPS = 3  # per point, after one untimed step


def _kinds(ranks: int) -> dict:
    """Each calibrated kind's layout: the ZeRO stages' and the pipeline's engines, and a TP and an SP group of 2
    on the ZeRO stage the planner pairs them with (time_model.Device.parallel_costs)."""
    from dstrain.plan.layouts import Layout

    kinds = {f"zero{z}": Layout(zero=z, micro=1) for z in range(4)}
    if ranks >= 2:  # DualPipeV takes the 1F1B engine's cost (time_model.engine_kind): the same instruction loop
        kinds.update(pipeline=Layout(zero=1, micro=1, pp=2), tp=Layout(zero=1, micro=1, tp=2))
        kinds["sp"] = Layout(zero=0, micro=1, sp=2)
    return kinds


def _points(kind: str) -> list[tuple[int, int]]:
    """(samples per micro-batch, micro-batches per step) at which a kind is timed."""
    if kind in ("tp", "sp"):
        return [(micro, ACCUMULATIONS[0]) for micro in PARALLEL_MICROS]
    return [(1, accumulation) for accumulation in ACCUMULATIONS]


def _strategy(recipe: Recipe, layout, ranks: int, micro: int, accumulation: int):
    from dstrain.strategy.resolve import resolve

    layout = dataclasses.replace(layout, micro=micro)
    dp = ranks // (layout.pp * layout.tp * layout.sp)
    batch = dataclasses.replace(recipe.train, global_batch=accumulation * micro * dp)
    one = dataclasses.replace(recipe, train=batch)
    return one, resolve(one, "calibration", layout.ds_config("fp32", True), "calibration", ranks)


def _step_seconds(engine, pipeline: bool, ids, accumulation: int) -> float:
    from dstrain.model.gpt import lm_loss

    start = time.perf_counter()
    if pipeline:
        engine.train_batch(iter([(ids, ids)] * accumulation))
    else:
        for _ in range(accumulation):
            engine.backward(lm_loss(engine(ids), ids))
            engine.step()
    return time.perf_counter() - start


def _measure_kind(small: Recipe, strategy, kind: str) -> list[float]:
    """Median seconds per step at each of the kind's points (a collective: every rank calls it); ``small`` and
    ``strategy``: the kind's layout at one sample per micro-batch (_strategy)."""
    import torch

    from dstrain.train.engine.build import build_engine, build_model

    pipeline = strategy.pp_stages > 1
    engine = build_engine(small, strategy, build_model(small, strategy))
    dp, seconds = strategy.dp_size, []
    for micro, accumulation in _points(kind):
        if accumulation != engine.gradient_accumulation_steps():  # (only the engine kinds'; TP/SP keep theirs)
            engine.set_train_batch_size(accumulation * dp)  # the engine's micro-batch stays 1: a plain one takes any
        ids = torch.randint(0, small.model.vocab_size, (micro, small.data.seq_len))
        if strategy.sp_size > 1:  # this rank's slice of the sequence (dstrain.train.engine.sequence.shard)
            part = small.data.seq_len // strategy.sp_size
            ids = ids[:, engine.mpu.get_sequence_parallel_rank() * part :][:, :part].contiguous()
        _step_seconds(engine, pipeline, ids, accumulation)
        times = [_step_seconds(engine, pipeline, ids, accumulation) for _ in range(TIMED_STEPS)]
        seconds.append(statistics.median(times))
    engine.destroy()
    return seconds


def _measure_rank(rank: int, ranks: int, port: int, recipe: Recipe, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks), MASTER_PORT=str(port)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch

    from dstrain.errors import DstrainError
    from dstrain.train.process import distributed

    distributed.init()
    out = {}
    for kind, layout in _kinds(ranks).items():
        torch.manual_seed(0)
        try:
            small, strategy = _strategy(recipe, layout, ranks, 1, ACCUMULATIONS[0])
        except DstrainError:  # a layout dstrain refuses for this recipe (the same on every rank): never planned
            continue
        out[kind] = _measure_kind(small, strategy, kind)
        if rank == 0:
            print(f"calibrated {kind}: {out[kind]}", file=sys.stderr, flush=True)
    if rank == 0:
        queue.put(out)
    distributed.shutdown()


def measured_steps(recipe: Recipe, ranks: int) -> dict[str, list[float]]:
    """Median seconds per step of each calibrated kind at its points (_points)."""
    from dstrain.train.process.distributed import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_measure_rank, args=(r, ranks, port, recipe, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        steps = queue.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
    return steps


def with_engine_costs(recipe: Recipe, device: Device, ranks: int) -> Device:
    """``device`` with each engine kind's unpredicted seconds per step and per micro-batch, and each parallel
    kind's per micro-batch and per sample beyond its ZeRO stage's engine (module docstring)."""
    from dstrain.plan.time_model import layout_counts

    steps = measured_steps(recipe, ranks)
    cluster = Cluster(device, 1, ranks)
    residuals: dict[str, list[float]] = {}
    kinds = _kinds(ranks)
    for kind, layout in kinds.items():
        if kind not in steps:
            continue
        residuals[kind] = []
        for (micro, accumulation), seconds in zip(_points(kind), steps[kind]):
            one, strategy = _strategy(recipe, layout, ranks, micro, accumulation)
            residuals[kind].append(seconds - predict(one, strategy, layout_counts(one, strategy), cluster).step_s)
    costs = []
    for kind in (k for k in residuals if k not in ("tp", "sp")):
        first, second = residuals[kind]
        per_micro = max(0.0, (second - first) / (ACCUMULATIONS[1] - ACCUMULATIONS[0]))
        costs.append((kind, max(0.0, first - ACCUMULATIONS[0] * per_micro), per_micro))
    device = dataclasses.replace(device, engine_costs=tuple(costs))
    parallel = []
    for kind in (k for k in residuals if k in ("tp", "sp")):
        base = device.engine_seconds(f"zero{kinds[kind].zero}", ACCUMULATIONS[0])
        small, large = ((r - base) / ACCUMULATIONS[0] for r in residuals[kind])  # per micro-batch
        per_sample = max(0.0, (large - small) / (PARALLEL_MICROS[1] - PARALLEL_MICROS[0]))
        parallel.append((kind, max(0.0, small - PARALLEL_MICROS[0] * per_sample), per_sample))
    return dataclasses.replace(device, parallel_costs=tuple(parallel))
