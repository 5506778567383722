"""Start N ranks of a gloo process group from pytest (no launcher: ~15 s cheaper per run).

The ranks are forked from a forkserver that imported torch, DeepSpeed and dstrain's trainer once per test session
(per xdist worker: each has its own forkserver, and its own block of rendezvous ports, tests/workers.py):
a spawned rank spent ~7 s of its ~8 s in a small training importing them (torch._dynamo alone 1.8 s, which every
torch optimizer's constructor imports). A forked rank then takes on what a spawned one had from the test that
started it: the working directory, the environment, and stdout/stderr (so capfd sees what the ranks print).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import sys
import time
import traceback
from multiprocessing import reduction

from workers import free_port  # noqa: F401  (this worker's block of ports; tests import it from here too)

# What every rank imports. Forking after them is what torch's DataLoader workers do; none reads an environment
# variable at import that a test sets for its ranks.
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "dstrain.train.run", "dstrain.train.engine.build"]
_context = None


def rank_context():
    """The multiprocessing context of the ranks (a forkserver that preloaded PRELOAD)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class _FromTheTest:
    """What a spawned rank inherited from the test that started it, taken when the rank's Process is pickled for the
    forkserver (at its start): the working directory, the environment, and fds 1 and 2 (DupFd sends them along)."""

    def __reduce__(self):
        return _Inherited, (os.getcwd(), dict(os.environ), (reduction.DupFd(1), reduction.DupFd(2)))


class _Inherited:
    def __init__(self, cwd: str, environ: dict, fds: tuple) -> None:
        self.cwd, self.environ, self.fds = cwd, environ, fds

    def adopt(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target_fd, fd in zip((1, 2), self.fds):
            os.dup2(fd.detach(), target_fd)
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)


def _child(rank: int, world: int, port: int, env: dict, target, args, queue, inherited: _Inherited) -> None:
    inherited.adopt()
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
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, env or {}, target, args, queue, _FromTheTest()))
        for r in range(world)
    ]
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
    ctx = rank_context()
    port = free_port()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, {}, target, args, queue, _FromTheTest())) for r in range(world)
    ]
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
