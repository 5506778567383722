"""Hang watchdog: a thread on every rank that turns a silent hang into stacks, a named rank and an exit.

The loop tells the watchdog where it is: ``begin(phase, step)`` at the start of each step, evaluation and
checkpoint, ``mark(where)`` at each point inside a step (forward, backward, optimizer step, the step's all-reduce).
Every rank makes the same calls in the same order, so the number of calls made so far (the tick) says how far a
rank got. A step is bounded by ``factor`` x the median duration of the last 50 steps after ``warmup_steps``, kept
within [floor_s, ceiling_s]; evaluation, checkpoints and the first steps by ceiling_s alone.

When a phase outlives its bound, the rank writes every thread's stack (``faulthandler``) to
``run_dir/hang/rank<r>.txt`` and its tick to ``hang/rank<r>.json``, then waits up to REPORT_WAIT_S for the other
ranks' reports (run_dir is shared by every rank: checkpoints need it so). The ranks that got furthest (they reached
the collective the others never joined) name the ranks behind them, or silent (frozen, dead), on stderr and in
their stack file; then every rank exits with HANG_EXIT, so that Slurm's requeue or a retry resumes from the last
checkpoint. Files rather than a collective: the process group is the thing that hangs.

On NCCL, torch's flight recorder (the ring buffer of recent collectives) is switched on before the process group
starts, and its dump is saved beside the stacks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque

from dstrain.config import WatchdogConfig
from dstrain.files import write_json_atomic
from dstrain.run_dir import RunDir
from dstrain.train.step.components import Component
from dstrain.train.step.handle import RunHandle

HANG_EXIT = 124  # as coreutils' timeout: the job ran out of time, not out of luck with its inputs
REPORT_WAIT_S = 10.0  # how long a rank that fired waits for the others' reports before naming the silent ones
LAGGARD_DELAY_S = 1.0  # a rank behind the others exits this much later, so that they name it before it is gone
MEDIAN_OF = 50  # step durations in the median
HANG_EVENT = "event.json"  # in run_dir/hang/: the hang the reporting rank saw, for the next launch to log


def enable_flight_recorder(files: RunDir, backend: str) -> None:
    """Before the process group starts: torch's NCCL flight recorder, dumped into run_dir/hang/ on a timeout."""
    if backend != "nccl":
        return
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(files.hang / "nccl_trace_rank_"))


class Watchdog(threading.Thread, Component):
    def __init__(self, config: WatchdogConfig, files: RunDir, rank: int, world: int, backend: str = "gloo"):
        super().__init__(name="dstrain-watchdog", daemon=True)
        self.config, self.dir, self.rank, self.world, self.backend = config, files.hang, rank, world, backend
        self.phase, self.step, self.where, self.tick = "start", 0, "start", 0
        self.started = self.created = time.monotonic()
        self.born = time.time()  # reports older than this are from an earlier launch
        self.durations: deque[float] = deque(maxlen=MEDIAN_OF)
        self.steps_seen = 0
        self.stopped = threading.Event()
        if backend == "nccl":
            self.dir.mkdir(parents=True, exist_ok=True)  # the flight recorder dumps here and does not create it

    # --- called by the loop (plain attribute writes: nothing on the training path waits) -------------------------
    def begin(self, phase: str, step: int) -> None:
        now = time.monotonic()
        if self.phase == "step":
            self.steps_seen += 1
            if self.steps_seen > self.config.warmup_steps:
                self.durations.append(now - self.started)
        self.phase, self.step, self.where, self.started = phase, step, phase, now
        self.tick += 1

    def mark(self, where: str) -> None:
        self.where = where
        self.tick += 1

    def stop(self) -> None:
        self.stopped.set()

    # --- as the trainer's component ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        self.start()

    def on_phase(self, phase: str, step: int) -> None:
        self.begin(phase, step)

    def on_mark(self, where: str) -> None:
        self.mark(where)

    def close(self) -> None:
        self.stop()

    # --- the thread ------------------------------------------------------------------------------------------------
    def bound(self) -> float:
        c = self.config
        if self.phase != "step" or not self.durations:
            return c.ceiling_s
        return min(c.ceiling_s, max(c.floor_s, c.factor * statistics.median(self.durations)))

    def run(self) -> None:
        poll = min(1.0, self.config.floor_s / 10)
        while not self.stopped.wait(poll):
            elapsed, bound = time.monotonic() - self.started, self.bound()
            if elapsed > bound:
                self.fire(elapsed, bound)

    def fire(self, elapsed: float, bound: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = f"{self.where} of {self.phase} {self.step}" if self.phase == "step" else f"{self.phase}"
        stacks = self.dir / f"rank{self.rank}.txt"
        with open(stacks, "w") as f:
            f.write(f"rank {self.rank}: {state} running for {elapsed:.1f} s, bound {bound:.1f} s\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self._dump_flight_recorder()
        report = {"rank": self.rank, "tick": self.tick, "state": state}
        write_json_atomic(self.dir / f"rank{self.rank}.json", report)
        reports = self._reports()
        furthest = max(r["tick"] for r in reports.values())
        behind = {r: reports.get(r) for r in range(self.world) if r not in reports or reports[r]["tick"] < furthest}
        if self.tick == furthest:
            named = "; ".join(
                f"rank {r} {'at ' + report['state'] if report else 'sent no report (frozen or dead)'}"
                for r, report in behind.items()
            )
            line = (
                f"dstrain: hang: rank {self.rank} stalled {elapsed:.0f} s (bound {bound:.0f} s) at {state}; "
                + (f"waiting for {named}" if behind else "every rank stalled at the same point (a collective or I/O)")
                + f"; stacks in {self.dir}/; exiting {HANG_EXIT} to be relaunched from the last checkpoint"
            )
            with open(stacks, "a") as f:
                f.write("\n" + line + "\n")
            print(line, file=sys.stderr, flush=True)
            # "ranks": the ranks behind, whose hosts slurm/train.sbatch leaves out of its next launch (train/elastic).
            # The first report of this launch stands: a frozen rank woken as its step is ended (Slurm sends SIGCONT
            # before SIGTERM) fires late, finds every report at its own tick and would name no one.
            hang = {"hang_step": self.step, "at": state, "detail": line, "ranks": sorted(behind)}
            if not self._reported():
                write_json_atomic(self.dir / HANG_EVENT, hang)  # logged by the next launch (HangEvent)
        else:
            time.sleep(LAGGARD_DELAY_S)
        os._exit(HANG_EXIT)

    def _reported(self) -> bool:
        """Whether a rank of this launch already wrote the hang event."""
        try:
            return (self.dir / HANG_EVENT).stat().st_mtime >= self.born - 1
        except OSError:
            return False

    def _reports(self) -> dict[int, dict]:
        """This launch's reports (an earlier launch's are older than this watchdog), waiting for all or a while."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            reports = {}
            for r in range(self.world):
                path = self.dir / f"rank{r}.json"
                try:
                    if path.stat().st_mtime >= self.born - 1:
                        reports[r] = json.loads(path.read_text())
                except (OSError, ValueError):
                    pass
            if len(reports) == self.world or time.monotonic() > deadline:
                return reports
            time.sleep(0.1)

    def _dump_flight_recorder(self) -> None:
        if self.backend != "nccl":
            return
        try:
            import torch

            dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)  # the flight recorder's dump
            trace = dump() if dump is not None else None
        except RuntimeError:
            return
        if trace is None:
            return
        (self.dir / f"nccl_trace_rank{self.rank}.pkl").write_bytes(trace)


def build(run: RunHandle) -> Watchdog | None:
    config = run.recipe.train.watchdog
    if not config.enabled:
        return None
    from deepspeed.accelerator import get_accelerator

    return Watchdog(config, run.files, run.rank, run.world, get_accelerator().communication_backend_name())


def build_hang_event(run: RunHandle) -> HangEvent:
    return HangEvent(run)


class HangEvent(Component):
    """The hang the previous launch's watchdog reported, as an event of this launch's metrics.jsonl (and so of its
    dashboards), logged once at its first step: the watchdog's thread ends the process and cannot write it itself."""

    def __init__(self, run: RunHandle) -> None:
        self.run, self.report = run, run.files.hang / HANG_EVENT

    def on_train_start(self) -> None:
        if not self.run.is_rank0 or not self.report.is_file():
            return
        event = json.loads(self.report.read_text())
        self.run.log.write({"step": self.run.progress.step, "event": "hang", **event})
        os.replace(self.report, self.report.with_name("event.logged.json"))
