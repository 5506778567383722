"""The pre-clip global gradient norm where DeepSpeed keeps none: ZeRO stage 0 in fp32.

DeepSpeed 0.19.8's ``DeepSpeedEngine._take_model_step`` clips a ZeRO-0 fp32 model through
``clip_fp32_gradients`` -> ``runtime.utils.clip_grad_norm_`` and drops the norm it computes, so
``engine.get_global_grad_norm()`` stays None on every step (tests/test_grad_norm.py::
test_deepspeed_keeps_no_grad_norm_without_zero). Under pipeline stages that same path clips by the wrong
norm: ``clip_grad_norm_`` counts a gradient only on model-parallel rank 0 (the first stage) unless the
parameter is tensor-parallel, then sums over the stages, so every stage is clipped by the first stage's
norm alone (test_deepspeed_pipeline_zero0_clips_by_the_first_stage_only).

``install`` is the one workaround for both: for the engines that take that path it computes the norm as
the ZeRO optimizers do (``stage_1_and_2.get_grad_norm_direct``: every gradient once — tied copies on
later pipeline stages and tensor-parallel replicas skipped —, summed over the model-parallel group, each
gradient's norm taken in ``get_norm_dtype()``: fp64 where the device has it), clips by it with DeepSpeed's
coefficient ``min(1, clip / (norm + 1e-6))``, and keeps it where ``get_global_grad_norm`` reads it.

A third defect hangs a pipeline under ZeRO-1 (and fp16): ``DeepSpeedEngine._configure_optimizer`` drops the
parameter groups that are empty on a rank, and ``stage_1_and_2.scaled_global_norm`` all-reduces each group's
norm over the model-parallel group, so a stage holding only matrices (an embedding, an untied head: no 1-D
parameter for the no-decay group) makes one all-reduce fewer than the others and every rank waits
(test_deepspeed_pipeline_zero1_drops_a_stages_empty_group). ``pad_group_norms`` makes the missing calls.
"""

from __future__ import annotations

import types

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from dstrain.errors import DstrainError


def takes_the_clip_fp32_path(engine) -> bool:
    """The engines whose step DeepSpeed clips with ``clip_fp32_gradients`` and keeps no norm for."""
    return not (
        engine.fp16_enabled()
        or engine.bfloat16_enabled()
        or engine.zero_optimization()
        or getattr(engine, "torch_autocast_z0_gradscaler", None)
    )


def global_grad_norm(engine) -> torch.Tensor:
    """L2 norm of the whole model's gradient (already averaged over data-parallel ranks), on every rank."""
    mpu = engine.mpu
    counts_replicated = mpu is None or bwc_tensor_model_parallel_rank(mpu) == 0
    # In fp64 as the ZeRO optimizers do: torch's CPU vector_norm sums fp32 in one running accumulator, 1e-4 off on a
    # 4096 x 128 lm_head gradient (tests/test_grad_norm.py::test_fp32_vector_norm_drifts_on_cpu), which moved the
    # tiny recipe's ZeRO-0 norm 1e-5 away from ZeRO-1/2/3's over the very same gradients.
    dtype = get_norm_dtype()
    squares = torch.zeros((), dtype=dtype, device=engine.device)
    experts: dict[str, torch.Tensor] = {}  # expert-parallel group name -> this rank's experts' squares
    for param in engine.module.parameters():
        if param.grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        if counts_replicated or is_model_parallel_parameter(param):
            square = torch.linalg.vector_norm(param.grad.detach().to(dtype)).to(squares.device) ** 2
            if is_moe_param(param):
                experts[param.group_name] = experts.get(param.group_name, 0) + square
            else:
                squares += square
    squares += expert_squares(experts)
    squares = squares.float()  # fp32 from here, as ZeRO's sum (stage_1_and_2.get_grad_norm_direct)
    if mpu is not None:
        torch.distributed.all_reduce(squares, group=mpu.get_model_parallel_group())
    return squares.sqrt()


def expert_squares(experts: dict[str, torch.Tensor]) -> torch.Tensor | float:
    """The squares of every expert's gradient: each rank of an expert-parallel group holds other experts (EP2:
    half of each MoE layer's), summed over the group; without it a ZeRO-0 rank clipped by the norm of its own
    experts only, and the replicas of the dense weights were clipped by different norms."""
    from deepspeed.utils import groups

    total: torch.Tensor | float = 0.0
    for name in sorted(experts):  # the same order of all-reduces on every rank
        square = experts[name]
        torch.distributed.all_reduce(square, group=groups._get_expert_parallel_group(name))
        total = total + square
    return total


def install(engine) -> None:
    """Make ``engine`` compute, clip by and keep the global norm where DeepSpeed does not (see the module)."""
    if not takes_the_clip_fp32_path(engine):
        return
    take_model_step = engine._take_model_step

    def take_model_step_with_norm(lr_kwargs=None):
        norm = global_grad_norm(engine)
        clip = engine.gradient_clipping()
        if clip > 0:
            coefficient = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for param in engine.module.parameters():
                if param.grad is not None:
                    param.grad.detach().mul_(coefficient.to(param.grad.device))
        engine._global_grad_norm = norm
        take_model_step(lr_kwargs)

    engine._take_model_step = take_model_step_with_norm
    engine.clip_fp32_gradients = types.MethodType(lambda self: None, engine)  # clipped above, by the global norm


def pad_group_norms(engine) -> None:
    """A pipeline rank with fewer parameter groups than another stage makes the missing norm all-reduces after its
    own (module docstring). Any pairing of groups gives the same total: each all-reduce sums squares over the
    stages, and the total is the root of all of them. DeepSpeed's fp16 optimizers norm each group inside their step,
    where no call can be added: refused in one line. The bf16 optimizer and ZeRO-0 fp32 (``install``) take one norm
    over all groups and need nothing."""
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.utils import combine_grad_norm_groups
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(engine, deepspeed.PipelineEngine):
        return
    optimizer, group = engine.optimizer, engine.mpu.get_model_parallel_group()
    own = len(optimizer.param_groups)
    counts = torch.tensor([float(own), -float(own)], device=engine.device)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
    most, fewest = int(counts[0].item()), -int(counts[1].item())
    if most == fewest:
        return
    if isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        raise DstrainError(
            f"pipeline stages hold {fewest} and {most} parameter groups (a stage of matrices only has no no-decay "
            "group), and DeepSpeed 0.19.8's fp16 optimizer norms each group across the stages, so the step would "
            'hang: use bf16, ZeRO-1, or another "pipeline.partition_method"'
        )
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    missing = most - own
    scaled_global_norm = optimizer.scaled_global_norm

    def scaled_global_norm_with_the_missing_groups(norm_type=2):
        norms = [scaled_global_norm(norm_type)]
        norms += [optimizer.get_grad_norm_direct([], [], norm_type) for _ in range(missing)]
        return combine_grad_norm_groups(norms, norm_type=norm_type)

    optimizer.scaled_global_norm = scaled_global_norm_with_the_missing_groups
