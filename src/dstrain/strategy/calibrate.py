"""``dstrain plan --calibrate``: the time model's Device for the machine it runs on, measured in a few seconds.

The matmul rate is measured on the recipe's own shapes (tokens x d_model by d_model x ff_dim, fp32, with the
threads each rank will have when ``ranks`` share this machine's cores) at two token counts, which fixes both the
rate and the half-rate token count of ``Device.rate``. The collective bandwidth is an all-reduce of 16 MiB between
two gloo processes on this host (the bus bandwidth, as nccl-tests and the time model count it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from dstrain.config import Recipe
from dstrain.strategy.time_model import Device

ALL_REDUCE_BYTES = 16 * 2**20


def matmul_flops_per_s(tokens: int, d_in: int, d_out: int, threads: int, seconds: float = 0.3) -> float:
    """Forward + backward rate of one linear layer (3 matmuls of 2·tokens·d_in·d_out FLOPs), fp32."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, g = torch.randn(tokens, d_in), torch.randn(d_in, d_out), torch.randn(tokens, d_out)
        runs, start = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - start < seconds:
            x @ w, g @ w.t(), x.t() @ g
            runs += 1
        return 6 * tokens * d_in * d_out * runs / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)


def _all_reduce_rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensor = torch.ones(ALL_REDUCE_BYTES // 4)
        dist.all_reduce(tensor)  # warm-up: connections
        start, runs = time.perf_counter(), 0
        while runs < 3 or time.perf_counter() - start < 0.5:
            dist.all_reduce(tensor)
            runs += 1
        if rank == 0:
            queue.put((time.perf_counter() - start) / runs)
    finally:
        dist.destroy_process_group()


def all_reduce_gbps() -> float:
    """Bus bandwidth of a 2-rank gloo all-reduce on this host, in Gbit/s."""
    from dstrain.train.distributed import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    return ALL_REDUCE_BYTES * 2 * (2 - 1) / 2 / seconds * 8 / 1e9


def calibrated_device(recipe: Recipe, ranks: int) -> Device:
    """This machine as the time model's Device, for ``ranks`` ranks sharing its cores and memory."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    m = recipe.model
    small, large = recipe.data.seq_len, 8 * recipe.data.seq_len
    rate_small = matmul_flops_per_s(small, m.d_model, m.ff_dim, threads)
    rate_large = matmul_flops_per_s(large, m.d_model, m.ff_dim, threads)
    # rate(T) = R·T / (T + h) through both points; a flat or noisy curve falls back to no small-matmul penalty.
    ratio = rate_large / rate_small
    half = (large - small * ratio) / (ratio - 1) if ratio > 1 else 0.0
    half = max(0.0, half)
    top = rate_large * (large + half) / large
    gbps = all_reduce_gbps()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    return Device(
        name="this machine (calibrated)",
        memory_gib=memory_gib,
        peak_tflops={"fp32": top / 1e12},
        efficiency=1.0,
        half_tokens=int(half),
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        host_gbps=gbps,
        cpu_adam_params_per_s=top / 20,  # Adam: ~20 FLOPs per parameter, at the matmul rate (an upper bound)
    )
