"""DeepSpeed defect worked around here: a resumed DeepSpeedCPUAdam (ZeRO's CPU and NVMe optimizer offload) takes its
first step with other Adam bias corrections than the uninterrupted run, so the run drifts by one unit in the last
place and more (issue 55 §5; tests/test_cpu_adam_resume.py is the canary and the proof).

DeepSpeed 0.19.8's C++ Adam (csrc/includes/cpu_adam.h ``IncrementStep``) keeps beta1^t and beta2^t as running fp32
products: when the step it is handed is one more than its own count it multiplies by beta once more, otherwise it
recomputes ``std::pow(beta, step)``. A resumed run's optimizer is new (its count is 0), so its first step takes the
pow, which differs from the product of the uninterrupted run for most steps (beta2 = 0.95: after steps 5, 6, 7, 9,
10, ...; float32(0.95**6) = 0.73509187 against 0.7350918 multiplied out), and every later step multiplies on from
it. The optimizer's state dict holds Adam's step but not these powers, so no checkpoint can carry them. Upstream:
the running product for every step of an uninterrupted run is deepspeedai/DeepSpeed#7982 (the fix of #7819, ZeRO-3
sub-groups drifting within a step), which left the pow of a step that jumps, as after a load, as it was; no upstream
issue names the resume yet (searched December 2026). The canary fails once DeepSpeed restores the powers itself.

The workaround replays the steps already taken on a one-element scratch tensor before the first step after a
resume: the C++ optimizer then holds exactly the powers the uninterrupted run multiplied out (2 microseconds a
step: 0.2 s per 100,000 steps, measured on this repository's CPU machine)."""

from __future__ import annotations

import torch


def replay_bias_corrections(engine) -> int:
    """After a resume: bring DeepSpeedCPUAdam's C++ beta powers to the restored step, as an uninterrupted run holds
    them; the number of steps replayed (0 when the optimizer is another, or has not stepped)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's wrapper holds the basic optimizer
    if not isinstance(inner, DeepSpeedCPUAdam):
        return 0
    steps = {int(state["step"]) for state in inner.state.values() if "step" in state}
    betas = {tuple(group["betas"]) for group in inner.param_groups}
    if not steps or len(betas) != 1:
        return 0  # betas that differ between groups make DeepSpeed take the pow at every step, resumed or not
    (beta1, beta2), taken = betas.pop(), max(steps)
    param, grad, exp_avg, exp_avg_sq = (torch.zeros(1) for _ in range(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one OpenMP thread: 2 us a call, where a parallel region over one element costs ms
    try:
        for step in range(1, taken + 1):  # lr 0 on a scratch tensor: only IncrementStep's running products move
            inner.ds_opt_adam.adam_update(
                inner.opt_id, step, 0.0, beta1, beta2, 1e-8, 0.0, True, param, grad, exp_avg, exp_avg_sq
            )
    finally:
        torch.set_num_threads(threads)
    return taken
