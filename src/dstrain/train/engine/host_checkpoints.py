"""Activation checkpoints held in host memory: the ds_config's ``activation_checkpointing.cpu_checkpointing``
(DeepSpeed's own key), on every layout, not only under tensor parallelism.

DeepSpeed 0.19.8 does the moving (deepspeed.runtime.activation_checkpointing.checkpointing): each checkpointed
block's input leaves the device in the forward, to a pool of pinned host buffers on a side stream
(``_ActivationOffloadEngine``, keeping the last block's on the device: the backward needs it first), and comes back
before the block is recomputed in the backward. On a device without streams (the CPU accelerator) it copies in
place, blocking: ``copy_to_device`` then ``get_cpu_activations_for_backward``, which this module corrects.
"""

from __future__ import annotations

import torch


def _cpu_activations_for_backward(args, inputs):
    """DeepSpeed's get_cpu_activations_for_backward with its two statements in the order that keeps the data.

    DeepSpeed 0.19.8 defect: it empties each argument (``arg.data = torch.empty([])``) and only then keeps
    ``inp.data`` as the saved copy; where the host copy is the argument itself (``.to("cpu")`` of a tensor already
    in host memory, the CPU accelerator's case) the saved copy is the emptied scalar, and the backward's recompute
    fails ("both arguments to linear need to be at least 1D"). Not reported upstream from here (no network);
    tests/test_host_checkpoints.py::test_deepspeed_cpu_checkpointing_loses_host_resident_inputs fails when fixed."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import is_activation_to_checkpoint

    kept = []
    for arg, inp in zip(args, inputs):
        if is_activation_to_checkpoint(arg):
            saved = inp.data  # before arg is emptied: inp may be arg
            arg.data = torch.empty([], device=arg.device).data
            arg.saved_data = saved
        kept.append(arg)
    return kept


def install() -> None:
    """Route DeepSpeed's blocking host-copy path through the corrected function (idempotent)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    checkpointing.get_cpu_activations_for_backward = _cpu_activations_for_backward
