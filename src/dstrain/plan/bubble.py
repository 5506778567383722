"""The pipeline bubble, from DeepSpeed's own schedules: each rank runs its instruction list
(dstrain.plan.pipe_schedules.instructions) in order, a forward waits for the previous stage's forward of the same
micro-batch, a backward for the next stage's backward; the bubble is the step's length minus a rank's busy time.

Assumed: a forward of one stage takes F, its backward 2F (activation gradients and weight gradients, which
DeepSpeed's DualPipeV keeps inside BackwardPass: no zero-bubble split), every stage the same; the hand-offs take no
time (the time model charges them as point-to-point traffic). Closed forms are too easy to get wrong for DualPipeV;
the simulation follows whatever schedule DeepSpeed ships.
"""

from __future__ import annotations

from functools import cache

from dstrain.plan.pipe_schedules import instructions

BACKWARD_OVER_FORWARD = 2.0


@cache
def bubble_fraction(schedule: str, stages: int, micro_batches: int) -> float:
    """Idle time of the busiest rank over its compute time, for one optimizer step."""
    if stages == 1:
        return 0.0
    length, busy = _simulate(schedule, stages, micro_batches)
    return length / busy - 1.0


def _simulate(schedule: str, stages: int, micro_batches: int) -> tuple[float, float]:
    """(step length, busy time of one rank), a stage's forward taking 1 (half a rank's layers under DualPipeV)."""
    chunks = 2 * stages if schedule == "dualpipev" else stages
    cost = {"F": 1.0, "B": BACKWARD_OVER_FORWARD}
    if schedule == "dualpipev":  # each rank runs two stages of half the layers
        cost = {k: v / 2 for k, v in cost.items()}
    lists = [instructions(schedule, stages, micro_batches, r) for r in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock, cursor = [0.0] * stages, [0] * stages
    while any(c < len(ops) for c, ops in zip(cursor, lists)):
        moved = False
        for r in range(stages):
            while cursor[r] < len(lists[r]):
                kind, stage, mb = lists[r][cursor[r]]
                deps = [("F", stage - 1, mb)] if kind == "F" and stage > 0 else []
                if kind == "B":
                    deps = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < chunks - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                clock[r] = done[kind, stage, mb] = start + cost[kind]
                cursor[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule} schedule of {stages} stages deadlocks in the bubble model")
    busy = sum(cost[k] for k, _, _ in lists[0])
    return max(clock), busy
