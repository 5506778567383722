import os
import sys
import tempfile

# No hub access at run time, anywhere in the suite (set before transformers/datasets are imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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


KINDS = ("distributed", "launcher", "slurm", "gpu")


def pytest_collection_modifyitems(items):
    """A test that is none of the slower kinds is a unit test: `scripts/test -m unit` is the fast subset."""
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            item.add_marker(pytest.mark.unit)
