"""What the pytest-xdist workers of one test session share, and what each keeps to itself.

scripts/test runs the suite on several workers (`-n`); each is a pytest process of its own, with its own forkserver
of ranks (tests/ranks.py) and its own temp folder. Shared by all of them: one folder of the session (the prepared
corpus, the DeepSpeed op build's claim), found from any worker. Kept apart: the rendezvous ports, one block of
ports per worker below Linux's ephemeral range (32768-60999), so that neither another worker's pick nor the
ephemeral port of a gloo connection or listener (which bind port 0) can take a rank's MASTER_PORT between its pick
and its bind. Without xdist the session is one worker, "gw0".
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path

# The rendezvous ports: 10000-19999, under the ephemeral range and under the Slurm jobs' MASTER_PORT (20000 + id,
# slurm/train.sbatch); a block of PORTS_PER_WORKER each, 5 workers before the blocks repeat.
FIRST_PORT, PORTS_PER_WORKER, PORT_BLOCKS = 10_000, 2_000, 5


SESSION_ENV = "DSTRAIN_TEST_SESSION"  # the session folder, set by the main process, inherited by its workers


def worker_index() -> int:
    """This xdist worker's number (gw0: 0, ...), inherited by what it starts; 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name[2:].isdigit() else 0


def is_main(config) -> bool:
    """Whether this pytest process runs the session (xdist's controller, or the only process), not a worker."""
    return not hasattr(config, "workerinput")


def start_session(config) -> None:
    """In the main process, before the workers start (pytest_configure): a folder for the session, which the
    workers find through the environment they inherit. A pytest started by a test has a session of its own."""
    if is_main(config):
        os.environ[SESSION_ENV] = tempfile.mkdtemp(prefix="dstrain-tests-")


def session_folder() -> Path:
    """The folder every process of this test session shares; the main process removes it at the end."""
    return Path(os.environ[SESSION_ENV])


_next_port = random.randrange(PORTS_PER_WORKER)  # a random start: a second session's worker gw0 starts elsewhere


def free_port() -> int:
    """A TCP port of this worker's block that is free now (bindable on every address) and was not handed out by
    this process recently: the next of the block, round robin."""
    global _next_port
    block = FIRST_PORT + (worker_index() % PORT_BLOCKS) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        _next_port = (_next_port + 1) % PORTS_PER_WORKER
        port = block + _next_port
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: the ranks' TCPStore listens on all of them
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {block}-{block + PORTS_PER_WORKER - 1}")
