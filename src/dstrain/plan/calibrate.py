"""``dstrain plan --calibrate``: the time model's Device for the machine it runs on, measured in a few seconds.

The compute rate is measured on the recipe's own model: a forward and backward (fp32, with the threads each rank
will have when ``ranks`` share this machine's cores) at micro-batches of 1 and 4 samples, which fixes both the
rate (FLOPs per token over the seconds each added sample costs) and the fixed cost of a micro-batch (framework,
kernel launches: ``Device.micro_batch_overhead_s``). The collective bandwidth is an all-reduce of 16 MiB between
two gloo processes on this host (the bus bandwidth, as nccl-tests and the time model count it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from dstrain.config import Recipe
from dstrain.plan.time_model import Device

ALL_REDUCE_BYTES = 16 * 2**20


def forward_backward_seconds(recipe: Recipe, micro: int, threads: int, seconds: float = 1.0) -> float:
    """Median seconds of one forward + backward of the recipe's model on ``micro`` samples, on this host's CPU."""
    import statistics

    import torch

    from dstrain.model.gpt import GPT, lm_loss

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = GPT(recipe.model)
        ids = torch.randint(0, recipe.model.vocab_size, (micro, recipe.data.seq_len))
        times: list[float] = []
        while len(times) < 3 or (sum(times) < seconds and len(times) < 20):
            start = time.perf_counter()
            lm_loss(model(ids), ids).backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(previous)


def _all_reduce_rank(rank: int, rendezvous: str, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        tensor = torch.ones(ALL_REDUCE_BYTES // 4)
        dist.all_reduce(tensor)  # warm-up: connections
        start, runs = time.perf_counter(), 5  # the same count on both ranks: neither leaves the other waiting
        for _ in range(runs):
            dist.all_reduce(tensor)
        if rank == 0:
            queue.put((time.perf_counter() - start) / runs)
    finally:
        dist.destroy_process_group()


def all_reduce_gbps() -> float:
    """Bus bandwidth of a 2-rank gloo all-reduce on this host, in Gbit/s."""
    import tempfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:  # the ranks meet in a file: no port to find
        rendezvous = os.path.join(folder, "rendezvous")
        procs = [ctx.Process(target=_all_reduce_rank, args=(r, rendezvous, queue)) for r in range(2)]
        for p in procs:
            p.start()
        seconds = queue.get(timeout=120)
        for p in procs:
            p.join(timeout=30)
    return ALL_REDUCE_BYTES * 2 * (2 - 1) / 2 / seconds * 8 / 1e9


def calibrated_device(recipe: Recipe, ranks: int) -> Device:
    """This machine as the time model's Device, for ``ranks`` ranks sharing its cores and memory, from the bare
    model's forward and backward and a gloo all-reduce. What each DeepSpeed engine kind costs beyond that is
    measured by building engines, the commands' business (dstrain.commands.calibrate_engine: a minute or two more,
    which ``dstrain compare --plan`` spends and ``dstrain plan --calibrate`` does not)."""
    from dstrain.model.counts import flops_per_token

    threads = max(1, (os.cpu_count() or 1) // ranks)
    small, large = 1, 4
    t_small = forward_backward_seconds(recipe, small, threads)
    t_large = forward_backward_seconds(recipe, large, threads)
    # t(micro) = overhead + micro / rate_per_sample through both points
    per_sample = max((t_large - t_small) / (large - small), 1e-9)
    overhead = max(0.0, t_small - small * per_sample)
    rate = flops_per_token(recipe.model, recipe.data.seq_len) * recipe.data.seq_len / per_sample
    gbps = all_reduce_gbps()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    return Device(
        name="this machine (calibrated)",
        memory_gib=memory_gib,
        peak_tflops={"fp32": rate / 1e12},
        efficiency=1.0,
        half_tokens=0,
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        host_gbps=gbps,
        cpu_adam_params_per_s=rate / 20,  # Adam: ~20 FLOPs per parameter, at the model's rate (an upper bound)
        micro_batch_overhead_s=overhead,
        overlaps_communication=False,
        module_fetch_s=0.0,  # in the measured ZeRO-3 engine costs (dstrain compare --plan)
        host_memory_gib=memory_gib * ranks,  # the same memory the ranks' share is of
    )
