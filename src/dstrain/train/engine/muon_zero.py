"""Muon under ZeRO-1/2/3 (fp32): clip the raw gradient, then orthogonalise, as ZeRO-0 does.

DeepSpeed 0.19.8's ZeRO optimizers run Muon before they take the gradient norm: ZeRO-1/2 while building the gradient
partitions at the accumulation boundary (``stage_1_and_2.get_flat_partition`` calls ``muon_update`` on each whole Muon
matrix, during the backward), ZeRO-3 at the start of ``step`` (``stage3._apply_muon_to_accumulated_grads``). ``step``
then takes the global norm of the orthogonalised updates (and the AdamW half's gradients), reports it as the gradient
norm and clips by it (tests/test_muon_zero.py::test_deepspeed_zero_clips_the_orthogonalised_update). ZeRO-0 clips
the raw gradient by its global norm and only then runs Muon's momentum and Newton-Schulz on it
(train/engine/grad_norm.py),
so the same recipe gave other losses by ZeRO stage.

``install`` is the one workaround. Before DeepSpeed's Muon runs, it takes DeepSpeed's own norm over the raw gradient
partitions (the norm DeepSpeed takes for AdamW), scales every gradient by DeepSpeed's clip coefficient
``min(1, clip / (norm + 1e-6))``, runs DeepSpeed's Muon on the clipped gradients (its momentum handling untouched),
lets DeepSpeed step with its own clip off, and reports the raw norm. Under ZeRO-1/2 Muon is held back from the
backward for that: ``get_flat_partition`` builds the Muon groups' partitions from the raw gradient and keeps the whole
gradients it would have orthogonalised, and ``step`` runs the original on them once clipped.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm


def zero_stage(engine) -> int | None:
    """1 (ZeRO-1/2's optimizer) or 3 where ``engine`` steps Muon through a ZeRO optimizer on the device, else None
    (offload orthogonalises on its own path, ``_apply_muon_updates_cpu_offload``: refused before launch)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = engine.optimizer
    if not isinstance(getattr(zero, "optimizer", None), MuonWithAuxAdam):
        return None
    if isinstance(zero, DeepSpeedZeroOptimizer) and not zero.cpu_offload:
        return 1
    if isinstance(zero, DeepSpeedZeroOptimizer_Stage3) and not zero.offload_optimizer:
        return 3
    return None


def install(engine) -> None:
    """Make ``engine``'s ZeRO optimizer clip Muon's raw gradient (see the module)."""
    stage = zero_stage(engine)
    if stage is None:
        return
    zero = engine.optimizer
    raw_norm: list[torch.Tensor] = []  # this step's, taken before Muon
    clip = [zero.clip_grad]  # the recipe's (apply_recipe_to_optimizer may set it on resume); DeepSpeed's is 0 in step

    def clip_raw(partitions: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor | None:
        """Scale ``partitions`` by the clip coefficient of ``norm``; the coefficient, None where nothing is clipped."""
        raw_norm.append(norm)
        if clip[0] <= 0 or is_invalid_grad_norm(norm):  # an invalid norm: DeepSpeed's step skips the step
            return None
        coefficient = torch.clamp(clip[0] / (norm + 1e-6), max=1.0)
        for part in partitions:
            part.mul_(coefficient.to(part.device))
        return coefficient

    if stage == 1:
        orthogonalise = hold_back_muon_at_the_boundary(zero, clip_raw)
    else:
        orthogonalise = zero._apply_muon_to_accumulated_grads

        def apply_muon_to_clipped_grads() -> None:
            partitions = [part for group in zero.averaged_gradients.values() for part in group or []]
            clip_raw(partitions, combine_grad_norm_groups(zero._get_norm_groups()))
            orthogonalise()

        zero._apply_muon_to_accumulated_grads = apply_muon_to_clipped_grads
    step = zero.step

    def step_clipping_raw_gradients(closure=None):
        raw_norm.clear()
        clip[0] = zero.clip_grad
        if stage == 1:
            orthogonalise()
        zero.clip_grad = 0.0  # clipped before Muon: DeepSpeed would clip the orthogonalised update
        try:
            step(closure)
        finally:
            zero.clip_grad = clip[0]
        if raw_norm and not is_invalid_grad_norm(raw_norm[0]) and not zero.overflow:
            zero._global_grad_norm = raw_norm[0] / zero.loss_scale

    zero.step = step_clipping_raw_gradients


@contextmanager
def muon_held_back(params):
    """``get_flat_partition`` orthogonalises the parameters flagged ``use_muon``: unflag them for one call."""
    for param in params:
        param.use_muon = False
    try:
        yield
    finally:
        for param in params:
            param.use_muon = True


def hold_back_muon_at_the_boundary(zero, clip_raw: Callable) -> Callable[[], None]:
    """ZeRO-1/2: make ``get_flat_partition`` leave the Muon groups' gradients raw (keeping the whole gradients it would
    have orthogonalised); return what clips every partition and then runs DeepSpeed's Muon on the kept ones."""
    get_flat_partition = zero.get_flat_partition
    held: dict[int, tuple[list, list[torch.Tensor]]] = {}  # Muon group -> (get_flat_partition's call, whole grads)

    def get_flat_partition_of_raw_gradients(
        tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list=False
    ):
        call = [tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list]
        if not tensor_list or not zero._is_muon_group(tensor_list):
            return get_flat_partition(*call)
        held[param_group_idx] = (call, zero.all_grad_tensors[param_group_idx])
        with muon_held_back(tensor_list):
            return get_flat_partition(*call)

    def clip_then_orthogonalise() -> None:
        partitions = [
            part
            for group, partition in zero.averaged_gradients.items()
            if group not in held and partition is not None
            for part in (partition if isinstance(partition, list) else [partition])
        ]
        coefficient = clip_raw(partitions, zero.scaled_global_norm())
        for group, (call, grads) in held.items():
            for grad in grads if coefficient is not None else []:
                grad.mul_(coefficient.to(grad.device))
            zero.all_grad_tensors[group] = grads
            zero.averaged_gradients[group] = get_flat_partition(*call)  # DeepSpeed's Muon, on whole matrices
            zero.all_grad_tensors[group] = None
        held.clear()

    zero.get_flat_partition = get_flat_partition_of_raw_gradients
    return clip_then_orthogonalise
