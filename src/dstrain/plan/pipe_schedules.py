"""The activations a pipeline rank holds, from DeepSpeed's own schedules: each rank's instruction list
(``TrainSchedule`` for 1F1B, ``DualPipeVSchedule`` for DualPipeV), in order. The bubble these lists make is
dstrain.plan.bubble's.
"""

from __future__ import annotations

from functools import cache


@cache
def held_stages(schedule: str, stages: int, micro_batches: int) -> float:
    """Most activations a rank holds at once, in micro-batches of its whole layer share: forwards whose backward
    has not run yet (1F1B: min(stages, micro-batches) on the first stage; DualPipeV: stages of half the share)."""
    if stages == 1:
        return 1.0
    share = 0.5 if schedule == "dualpipev" else 1.0
    peak = 0.0
    for rank in range(stages):
        held = 0
        for kind, _, _ in instructions(schedule, stages, micro_batches, rank):
            held += 1 if kind == "F" else -1
            peak = max(peak, held * share)
    return peak


def instructions(schedule: str, stages: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind "F"/"B", global stage, micro-batch) of ``rank``'s forward and backward passes, in order."""
    from deepspeed.runtime.pipe import schedule as ds

    if schedule == "dualpipev":
        sched: ds.PipeSchedule = ds.DualPipeVSchedule(micro_batches=micro_batches, stages=stages, stage_id=rank)
    else:
        sched = ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=rank)
    seen = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}  # the k-th pass of a phase is micro-batch k
    out = []
    for step in sched.steps():
        for cmd in step:
            kind = "F" if isinstance(cmd, ds.ForwardPass) else "B" if isinstance(cmd, ds.BackwardPass) else None
            if kind is None:
                continue
            phase = getattr(cmd, "phase", 0)
            stage = rank if phase == 0 else 2 * stages - 1 - rank
            out.append((kind, stage, seen[kind, phase]))
            seen[kind, phase] += 1
    return out


__all__ = ["held_stages", "instructions"]
