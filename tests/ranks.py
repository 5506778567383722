"""Spawn N ranks of a gloo process group from pytest (no launcher: ~15 s cheaper per run)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import sys
import time
import traceback

from dstrain.train.distributed import free_port  # noqa: F401  (tests import it from here too)


def _child(rank: int, world: int, port: int, env: dict, target, args, queue) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = target(*args)
    except BaseException as e:  # report, then fail the process
        queue.put((rank, "error", "".join(traceback.format_exception(e))))
        raise
    queue.put((rank, "ok", result))
    if isinstance(result, int) and not isinstance(result, bool):
        sys.exit(result)  # a target returning an exit status (like dstrain.train's main) exits with it


def run_ranks(world: int, target, *args, env: dict | None = None, timeout: float = 1200) -> list:
    """Run ``target(*args)`` on ``world`` ranks; each rank's result, or raise with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, env or {}, target, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = queue.get(timeout=1)
            except queue_module.Empty:
                # A rank killed by a signal never reports: fail now, not at the timeout.
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead and queue.empty():
                    raise AssertionError(
                        f"rank {dead[0][0]} died with exit code {dead[0][1]} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ranks {sorted(set(range(world)) - set(results))} still running after {timeout} s"
                    ) from None
                continue
            results[rank] = (status, value)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 1)  # after a failure the others may wait forever
            if p.is_alive():
                p.kill()
    return [results[r][1] for r in range(world)]


def start_target_ranks(world: int, target, *args) -> list:
    """Start ``target(*args)`` on ``world`` ranks and return their processes (to kill, or to wait for)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, port, {}, target, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
        p.queue = queue  # the children unpickle it as they start: it must outlive this call
    return procs


def spawn_ranks(world: int, target, *args, timeout: float = 300) -> list[int | None]:
    """Run ``target(*args)`` on ``world`` ranks that may die; return their exit codes (None: still alive at timeout)."""
    procs = start_target_ranks(world, target, *args)
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def start_ranks(world: int, argv: list[str], cwd=None, env: dict | None = None) -> list:
    """``python -m dstrain.train`` once per rank as separate OS processes, the way a launcher starts them."""
    import subprocess
    import sys

    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "dstrain.train", *argv],
                cwd=cwd,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs
