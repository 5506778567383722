import os
import subprocess
import sys
import tempfile

# No hub access at run time, anywhere in the suite (set before transformers/datasets are imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No W&B from a developer's environment (WANDB_PROJECT turns it on): tests/test_monitors.py runs it offline itself.
os.environ["WANDB_MODE"] = "disabled"
# The venv's tools first (its ninja builds DeepSpeed's CPU ops; another ninja forces a rebuild of the cache).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
# datasets' Arrow cache of the test corpora goes with the test session, not into ~/.cache.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="dstrain-hf-datasets-"))

import pytest  # noqa: E402

from data_fixtures import tiny_corpus  # noqa: E402,F401  (a session fixture, shared by every test module)
from slurm_cluster import slurm_cluster  # noqa: E402,F401  (one cluster for the whole run)
from slurm_jobs import one_node_two_tasks, work  # noqa: E402,F401  (shared by the Slurm test modules)


@pytest.fixture(scope="session")
def corpus(tiny_corpus):
    """The prepared stdlib-docs corpus the trainer tests train on (read-only)."""
    return tiny_corpus


KINDS = ("distributed", "launcher", "slurm", "gpu", "harness")


def pytest_collection_modifyitems(items):
    """A test that is none of the slower kinds is a unit test: `scripts/test -m unit` is the fast subset. The
    modules of the tests that need DeepSpeed's async_io op run last, while it builds (pytest_collection_finish)."""
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            item.add_marker(pytest.mark.unit)
    late = {item.module for item in items if "async_io" in item.fixturenames}
    items.sort(key=lambda item: item.module in late)  # stable: each module's tests stay together, in order


# The DeepSpeed ops the ranks JIT-build on a CPU, in the order the suite first needs them (async_io's tests run last).
# torch's extension cache keeps them per machine; on a fresh one they are ~5 minutes of compiling.
JIT_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")
BUILD_OPS = f"""
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # torch's build lock is released on the way out
from deepspeed.ops import op_builder
for name in {JIT_OPS!r}:
    builder = getattr(op_builder, name)()
    try:
        builder.is_compatible(False) and builder.load(False)
    except Exception:  # the test that needs it builds it again, and says why it cannot
        pass
"""
_op_builds: subprocess.Popen | None = None


def pytest_collection_finish(session):
    """Where ranks will run, build DeepSpeed's ops in the background from the start, niced: the compiling then uses
    the cores the tests leave idle, and a test that needs an op first waits on torch's build lock at most."""
    global _op_builds
    if any(not item.get_closest_marker("unit") for item in session.items):
        _op_builds = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-c", BUILD_OPS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )


def pytest_sessionfinish(session):
    if _op_builds is not None and _op_builds.poll() is None:  # a session cut short (-x, Ctrl-C)
        _op_builds.terminate()  # not kill: a killed build's lock would keep the next session waiting on it forever
        _op_builds.wait(timeout=60)


@pytest.fixture(scope="session")
def async_io():
    """DeepSpeed's async_io op, which ZeRO-Infinity's NVMe swapping needs: JIT-built once per machine (about 3
    minutes of 2 cores, in the background from the start of the session; then cached in torch's extensions folder)
    before the ranks that use it start, so no test pays the build inside a timed run. Returns None when it loads,
    else why it cannot: the NVMe tests skip with that reason (and fail under CI=true, where scripts/test installs
    libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if _op_builds is not None:
        _op_builds.wait()  # its outcome is read again below: a cached load, or the error of building once more
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        reason = "DeepSpeed's async_io op cannot build here: libaio is missing (apt-get install libaio-dev)"
    else:
        try:
            builder.load(verbose=False)
            return None
        except Exception as e:  # a compiler error, a killed build's stale lock: say which
            reason = f"DeepSpeed's async_io op failed to build: {type(e).__name__}: {str(e).splitlines()[0]}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the NVMe tests cannot run under CI=true: {reason}", pytrace=False)
    return reason
