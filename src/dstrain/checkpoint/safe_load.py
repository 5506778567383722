"""The one way dstrain reads a ``.pt`` file: ``torch.load(weights_only=True)``, never code from a run folder.

A pickle can name any importable callable, and ``torch.load(weights_only=False)`` calls it: a checkpoint downloaded
with a run folder could run a command when it is resumed, exported, evaluated or sampled from. ``load`` unpickles
tensors, plain Python data and the exact DeepSpeed/numpy types a checkpoint of ours holds (``allowed_globals``);
anything else is refused in one line, before any object is built.

DeepSpeed 0.19.8 loads its own files with ``weights_only=False`` in several places that dstrain drives:
``TorchCheckpointEngine.load`` (``engine.load_checkpoint``: model, optimizer, pipeline layer files),
``checkpoint.universal_checkpoint`` and ``zero.stage3`` (a universal resume), ``checkpoint.ds_to_universal`` (the
converter behind a resume on another layout) and ``utils.zero_to_fp32`` (export of ZeRO checkpoints). They take
no loader argument, so ``only_weights()`` routes ``torch.load`` through ``load`` for the length of the DeepSpeed
call: the one named place where that upstream behaviour is worked around.
tests/test_untrusted.py::test_deepspeed_loads_checkpoints_with_weights_only_false fails when DeepSpeed stops.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import torch

from dstrain.errors import DstrainError


class UnsafeCheckpoint(DstrainError):
    """A checkpoint file whose pickle names something other than tensors and plain data."""


def allowed_globals() -> list:
    """What DeepSpeed and our client state pickle besides tensors and builtins (found by loading every layout the
    tests write: ZeRO-0..3, bf16/fp16, pipeline, AutoTP, NVMe, universal)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
        np._core.multiarray._reconstruct,  # type: ignore[attr-defined]  # where numpy 2 pickles arrays from
        ZeroStageEnum,
        LossScaler,
        DynamicLossScaler,
        fragment_address,
    ]


_real_torch_load = torch.load  # only_weights() replaces torch.load for a while; load itself always calls this


def load(path, map_location="cpu", mmap: bool | None = None):
    """``torch.load(path, weights_only=True)`` with ``allowed_globals``; a refused pickle is an UnsafeCheckpoint."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return _real_torch_load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        what = next((line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise UnsafeCheckpoint(
            f"{path}: holds more than tensors and plain data ({what.strip()[:160]}); not loaded, since loading it "
            f"could run code: use a checkpoint written by dstrain, or one you trust converted to safetensors"
        ) from None


def loads_safely(path: Path) -> None:
    """Unpickle ``path``'s structure only (its tensors stay memory-mapped, unread): an UnsafeCheckpoint if it
    names anything ``load`` refuses. Cheap enough to run on every file of a tag before any work."""
    try:
        load(path, mmap=True)
    except UnsafeCheckpoint:
        raise
    except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be memory-mapped: read it whole
        load(path)


def _forced(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
    return load(f, map_location=map_location, mmap=mmap)


@contextlib.contextmanager
def only_weights():
    """Inside: every ``torch.load`` (DeepSpeed's included) is ``load``. Not re-entrant across threads: the
    background checkpoint thread only saves."""
    saved, torch.load = torch.load, _forced
    try:
        yield
    finally:
        torch.load = saved
