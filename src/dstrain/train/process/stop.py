"""Stop requests: a signal, or the death of the launcher that started this rank.

Any of SIGINT (Ctrl-C), SIGTERM (kill, scancel, a container stop) and SIGUSR1 (a time limit) asks the
loop to finish its step, checkpoint and exit 0 with status "interrupted". One request often arrives
more than once: a signal to the whole process group reaches each rank directly and again through
its launcher (DeepSpeed's launch.py and torchrun forward SIGINT/SIGTERM to their children as SIGTERM),
and srun's and slurmd's copies of an scancel both reach the task. Those copies land within
milliseconds of each other, so all deliveries within REPEAT_WINDOW_S of the first are one request; a
signal after that is a deliberate second request and exits at once (128 + signal).

A rank whose launcher died can learn of it no other way than by watching: LauncherWatch.
"""

from __future__ import annotations

import os
import signal
import threading
import time

# Copies of one request arrive within milliseconds: launch.py's SIGTERM came 2 ms after the Ctrl-C's SIGINT
# (3 of 3 tries on a busy 2-core machine; launch.py walks the process tree with psutil first, which a loaded
# node slows). 2 s leaves a wide margin for that, yet stays below the few seconds after which a person whose
# first Ctrl-C "did nothing" presses again, and that deliberate second request must still exit at once.
REPEAT_WINDOW_S = 2.0
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
WATCH_INTERVAL_S = 0.5


class StopSignal:
    """The stop request of one training loop; ``received`` is the first signal number (or 0: launcher gone)."""

    active: StopSignal | None = None  # the newest; an older loop's watch ends when it is replaced

    def __init__(self, watch: bool = True):
        self.received: int | None = None
        self.received_at = 0.0
        self.replaced = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        StopSignal.active = self
        if watch:
            LauncherWatch(self).start()

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = signum, now
        elif now - self.received_at > REPEAT_WINDOW_S:
            raise SystemExit(128 + signum)

    def release(self) -> None:
        """Give the signals back to the handlers they had before (the loop is over; its checkpoint is written)."""
        for sig, handler in self.replaced.items():
            signal.signal(sig, handler)
        if StopSignal.active is self:
            StopSignal.active = None  # ends the launcher watch

    def request(self) -> None:
        """A stop request that is not a signal (the launcher died); never an "exit at once"."""
        if self.received is None:
            self.received, self.received_at = 0, time.monotonic()


# Processes whose command line names one of these started this rank and own its lifetime.
LAUNCHERS = ("deepspeed.launcher.launch", "torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate")


class LauncherWatch(threading.Thread):
    """Treat the death of this rank's launcher as a stop request, so that no rank trains on as an orphan.

    DeepSpeed 0.19.8's `deepspeed` command (deepspeed/launcher/runner.py, main()) installs its SIGINT/SIGTERM
    forwarding only for multi-node PDSH (`if args.launcher == PDSH_LAUNCHER and multi_node_exec`): on one
    node, `kill <its pid>` ends it in 0.1 s while its child launch.py and the ranks under it never hear of
    it. So under launch.py the rank also watches launch.py's parent, the `deepspeed` command.
    tests/test_launchers.py::test_deepspeed_runner_still_forwards_no_signal notices an upstream fix.
    Only launchers are watched: a plain `python -m dstrain.train` under nohup outlives its shell on purpose.
    """

    def __init__(self, stop: StopSignal):
        super().__init__(name="dstrain-launcher-watch", daemon=True)
        self.stop = stop
        self.watched = launcher_chain()

    def start(self) -> None:
        if self.watched:
            super().start()

    def run(self) -> None:
        while StopSignal.active is self.stop and self.stop.received is None:
            if any(parent_of(pid) != ppid for pid, ppid in self.watched):
                self.stop.request()
                return
            time.sleep(WATCH_INTERVAL_S)


def launcher_chain() -> list[tuple[int, int]]:
    """(pid, parent pid) pairs whose parent changing means a launcher died: re-parented to init or a subreaper."""
    import psutil  # a DeepSpeed requirement

    try:
        parent = psutil.Process(os.getppid())
        command = " ".join(parent.cmdline())
        watched = [(os.getpid(), parent.pid)]
        if "deepspeed.launcher.launch" in command:
            watched.append((parent.pid, parent.ppid()))  # the `deepspeed` command: see LauncherWatch
    except psutil.Error:
        return []
    return watched if any(name in command for name in LAUNCHERS) else []


def parent_of(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None
