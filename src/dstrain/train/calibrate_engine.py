"""What DeepSpeed's engines cost beyond the bare model's forward and backward, measured on this machine.

The bare-model calibration (dstrain.train.calibrate) sees none of the engine's own time: ZeRO's gradient hooks and
bucketing, ZeRO-3's gathers and releases per module, the pipeline engine's instruction loop, the optimizer step.
On 2 CPU ranks that time is most of a small model's step (BENCHMARKS.md: ~1 s per ZeRO-3 micro-batch against a
0-19 ms bare fixed cost). Here each engine kind (ZeRO-0..3 without model parallelism, a 2-stage pipeline) runs the
recipe's model on ``ranks`` gloo ranks at micro-batches of one sample, with 4 and then 8 micro-batches per step
(``set_train_batch_size``); whatever the time model does not predict of each step is split into a cost per
micro-batch and a cost per step, and the calibrated Device adds both to the prediction.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time

from dstrain.config import Recipe
from dstrain.strategy.time_model import Cluster, Device, engine_kind, predict

ACCUMULATIONS = (4, 8)  # micro-batches per step
TIMED_STEPS = 3  # per accumulation, after one untimed step


def _kinds(ranks: int) -> list:
    from dstrain.strategy.layouts import Layout

    kinds = [Layout(zero=z, micro=1) for z in range(4)]
    if ranks >= 2:  # DualPipeV takes 1F1B's (time_model.engine_kind): its engine hung in this loop, not in training
        kinds.append(Layout(zero=1, micro=1, pp=2))
    return kinds


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


def _measure_rank(rank: int, ranks: int, port: int, recipe: Recipe, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks), MASTER_PORT=str(port)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch

    from dstrain.strategy.resolve import resolve
    from dstrain.train import distributed
    from dstrain.train.engine import build_engine, build_model

    distributed.init()
    torch.manual_seed(0)
    ids = torch.randint(0, recipe.model.vocab_size, (1, recipe.data.seq_len))
    out = {}
    for layout in _kinds(ranks):
        dp = ranks // layout.pp
        batch = dataclasses.replace(recipe.train, global_batch=ACCUMULATIONS[0] * dp)
        small = dataclasses.replace(recipe, train=batch)
        strategy = resolve(small, "calibration", layout.ds_config("fp32", True), "calibration", ranks)
        engine = build_engine(small, strategy, build_model(small, strategy))
        seconds = []
        for accumulation in ACCUMULATIONS:
            engine.set_train_batch_size(accumulation * dp)
            _step_seconds(engine, layout.pp > 1, ids, accumulation)
            times = [_step_seconds(engine, layout.pp > 1, ids, accumulation) for _ in range(TIMED_STEPS)]
            seconds.append(statistics.median(times))
        out[engine_kind(strategy)] = (strategy, seconds)
        if rank == 0:
            print(f"calibrated {engine_kind(strategy)}: {seconds}", file=sys.stderr, flush=True)
        engine.destroy()
    if rank == 0:
        queue.put({kind: seconds for kind, (_, seconds) in out.items()})
    distributed.shutdown()


def measured_steps(recipe: Recipe, ranks: int) -> dict[str, list[float]]:
    """Median seconds per step of each engine kind at ACCUMULATIONS micro-batches of one sample."""
    from dstrain.train.distributed import free_port

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
    """``device`` with each engine kind's unpredicted seconds per step and per micro-batch (module docstring)."""
    from dstrain.strategy.resolve import resolve
    from dstrain.strategy.time_model import layout_counts

    steps = measured_steps(recipe, ranks)
    cluster = Cluster(device, 1, ranks)
    costs = []
    for layout in _kinds(ranks):
        dp = ranks // layout.pp
        residual: list[float] = []
        for accumulation in ACCUMULATIONS:
            batch = dataclasses.replace(recipe.train, global_batch=accumulation * dp)
            one = dataclasses.replace(recipe, train=batch)
            strategy = resolve(one, "calibration", layout.ds_config("fp32", True), "calibration", ranks)
            predicted = predict(one, strategy, layout_counts(one, strategy), cluster).step_s
            residual.append(steps[engine_kind(strategy)][len(residual)] - predicted)
        per_micro = max(0.0, (residual[1] - residual[0]) / (ACCUMULATIONS[1] - ACCUMULATIONS[0]))
        per_step = max(0.0, residual[0] - ACCUMULATIONS[0] * per_micro)
        costs.append((engine_kind(strategy), per_step, per_micro))
    return dataclasses.replace(device, engine_costs=tuple(costs))
