import os
import shutil
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
# An xdist worker (scripts/test) takes its share of the cores for torch's threads (set before torch is imported):
# more threads than cores spin in OpenMP's barriers (the family tests took 7 times the CPU at 2 threads a worker, 2
# workers on 2 busy cores). What the tests launch inherits it, as most of them set OMP_NUM_THREADS=1 already.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import psutil  # noqa: E402
import pytest  # noqa: E402

import workers  # noqa: E402
from data_fixtures import tiny_corpus  # noqa: E402,F401  (a session fixture, shared by every test module)
from slurm_cluster import slurm_cluster  # noqa: E402,F401  (one cluster for the whole run)
from slurm_jobs import one_node_two_tasks, work  # noqa: E402,F401  (shared by the Slurm test modules)


def pytest_configure(config):
    workers.start_session(config)


@pytest.fixture(scope="session")
def corpus(tiny_corpus):
    """The prepared stdlib-docs corpus the trainer tests train on (read-only)."""
    return tiny_corpus


KINDS = ("distributed", "launcher", "slurm", "gpu", "harness")
# What a test of each kind costs, roughly (seconds of 2 busy cores): the modules run longest first, so that under
# xdist no long module starts last while the other workers idle.
KIND_COST_S = {"slurm": 60.0, "launcher": 20.0, "harness": 10.0, "distributed": 6.0, "gpu": 0.2}  # gpu: skips
UNIT_COST_S = 0.2
LAUNCH_KINDS = ("distributed", "launcher", "slurm", "harness")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """A test that is none of the slower kinds is a unit test: `scripts/test -m unit` is the fast subset.

    The order (each module's tests stay together, in order): the modules that launch, longest first; then those
    needing DeepSpeed's async_io op, which has built in the background meanwhile (pytest_collection_finish); then the
    modules of unit tests, longest first, which fill the end evenly. The tests on the Slurm cluster form one xdist
    group: one worker runs them, on the session's one cluster."""
    cost: dict = {}
    for item in items:
        kinds = [kind for kind in KINDS if item.get_closest_marker(kind)]
        if not kinds:
            item.add_marker(pytest.mark.unit)
        if "slurm_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        cost[item.module] = cost.get(item.module, 0.0) + max((KIND_COST_S[k] for k in kinds), default=UNIT_COST_S)
    late = {item.module for item in items if "async_io" in item.fixturenames}
    launching = {item.module for item in items if any(item.get_closest_marker(kind) for kind in LAUNCH_KINDS)}

    def place(item) -> tuple:
        module = item.module
        return (2 if module not in launching else 1 if module in late else 0, -cost[module])

    items.sort(key=place)  # stable: a module's tests keep their order


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # xdist's hook
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup` (pyproject.toml): a module is one unit of work (its module-scoped fixtures, e.g. the
    launcher stops, are made once, on one worker), an xdist group is one, and the units go out in the collection's
    order (the longest first) to whichever worker is free."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's suffix for a test of an xdist_group
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # not by the number of tests: by the order collected
    return ModuleScheduling(config, log)


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
RANK_KINDS = ("distributed", "launcher", "slurm")  # the kinds that start ranks on the CPU, which JIT-load the ops
BUILD_CLAIM = "op-builds.pid"  # in the session folder: the pid of the one build of the session
_op_builds: subprocess.Popen | None = None


def pytest_collection_finish(session):
    """Where ranks will run, build DeepSpeed's ops in the background from the start, niced: the compiling then uses
    the cores the tests leave idle, and a test that needs an op first waits on torch's build lock at most. One
    build per session: under xdist the first worker to claim it starts it (the others' loads wait on torch's lock
    of the op being built); the session's main process stops one still running at the end (pytest_sessionfinish)."""
    global _op_builds
    if not any(item.get_closest_marker(kind) for item in session.items for kind in RANK_KINDS):
        return
    try:
        claim = os.open(workers.session_folder() / BUILD_CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    _op_builds = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", BUILD_OPS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    os.write(claim, str(_op_builds.pid).encode())
    os.close(claim)


def pytest_sessionfinish(session):
    """In the session's main process, after every worker: stop the op build if it still runs (a session cut short,
    or one whose tests needed no async_io), then remove the session folder."""
    if not workers.is_main(session.config):
        return
    folder = workers.session_folder()
    if _op_builds is not None:
        _op_builds.poll()  # reaped if it is over
    try:
        build = psutil.Process(int((folder / BUILD_CLAIM).read_text()))
        if build.cmdline()[-1:] == [BUILD_OPS]:  # still the build (a pid is reused once its process is gone)
            build.terminate()  # not kill: a killed build's lock would keep the next session waiting on it forever
            build.wait(timeout=60)
    except (OSError, ValueError, psutil.Error):  # no build was claimed, or it is over
        pass
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def async_io():
    """DeepSpeed's async_io op, which ZeRO-Infinity's NVMe swapping needs: JIT-built once per machine (about 3
    minutes of 2 cores, in the background from the start of the session; then cached in torch's extensions folder)
    before the ranks that use it start, so no test pays the build inside a timed run. Returns None when it loads,
    else why it cannot: the NVMe tests skip with that reason (and fail under CI=true, where scripts/test installs
    libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if _op_builds is not None:  # this process's build (another worker's: the load below waits on torch's lock)
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
