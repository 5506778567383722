import os
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


@pytest.fixture(scope="session")
def corpus(tiny_corpus):
    """The prepared stdlib-docs corpus the trainer tests train on (read-only)."""
    return tiny_corpus


KINDS = ("distributed", "launcher", "slurm", "gpu", "harness")


def pytest_collection_modifyitems(items):
    """A test that is none of the slower kinds is a unit test: `scripts/test -m unit` is the fast subset."""
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def async_io():
    """DeepSpeed's async_io op, which ZeRO-Infinity's NVMe swapping needs: JIT-built once per machine (about 5
    minutes on 2 busy cores, then cached in torch's extensions folder) before the ranks that use it start, so no
    test pays the build inside a timed run. Returns None when it loads, else why it cannot: the NVMe tests skip with
    that reason (and fail under CI=true, where scripts/test installs libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

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
