"""The checks of a recipe that span several of its fields (each field's type and range is checked where it is
declared, by dstrain.typed_yaml): one line naming the recipe file, the keys and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.errors import DstrainError
from dstrain.objectives.registry import check_one_objective

if TYPE_CHECKING:
    from dstrain.config import Recipe


def validate(recipe: Recipe, file: Path) -> None:
    """Checks that span several fields (types were checked by ``parse``)."""
    t = recipe.train
    if (t.steps is None) == (t.tokens is None):
        raise DstrainError(f"{file}: set exactly one of train.steps and train.tokens")
    for key, value in [("train.global_batch", t.global_batch), ("data.seq_len", recipe.data.seq_len)]:
        if value <= 0:
            raise DstrainError(f"{file}: {key} must be positive, got {value}")
    if not recipe.data.sources:
        raise DstrainError(f"{file}: data.sources is empty; name at least one folder written by dstrain prepare")
    validate_stages(recipe, file)
    check_one_objective(recipe, file)
    max_len = recipe.model.max_seq_len
    if max_len is not None and recipe.data.seq_len > max_len:
        raise DstrainError(
            f"{file}: data.seq_len={recipe.data.seq_len} exceeds model.max_seq_len={max_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    names = [task.name for task in t.tasks]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise DstrainError(f"{file}: train.tasks names {twice!r} twice; give each task its own name")
    if t.early_stop.patience and not t.eval_interval:
        raise DstrainError(
            f"{file}: train.early_stop.patience={t.early_stop.patience} counts evaluations, and train.eval_interval is "
            f"0 (only at the end); set train.eval_interval, or train.early_stop.patience: 0"
        )
    w = t.watchdog
    if w.floor_s > w.ceiling_s:
        raise DstrainError(
            f"{file}: train.watchdog.floor_s={w.floor_s:g} exceeds train.watchdog.ceiling_s={w.ceiling_s:g}; "
            f"lower floor_s or raise ceiling_s"
        )
    if t.averaging.enabled and t.averaging.start_step >= recipe.total_steps:
        raise DstrainError(
            f"{file}: train.averaging.start_step={t.averaging.start_step} leaves nothing of the run's "
            f"{recipe.total_steps} steps to average; set it below {recipe.total_steps}"
        )
    if recipe.schedule.warmup_steps > recipe.total_steps:
        raise DstrainError(
            f"{file}: schedule.warmup_steps={recipe.schedule.warmup_steps} exceeds the run's {recipe.total_steps} steps"
        )


def validate_stages(recipe: Recipe, file: Path) -> None:
    """Each mixture names every source and samples some; stages start in order, inside the run."""
    sources = recipe.data.sources
    if not any(s.weight > 0 for s in sources):
        raise DstrainError(f"{file}: every data.sources weight is 0; give at least one source a positive weight")
    for i, stage in enumerate(recipe.data.stages):
        key = f"data.stages[{i}]"
        given = [k for k in ("start_step", "start_tokens", "start_fraction") if getattr(stage, k) is not None]
        if len(given) != 1:
            raise DstrainError(f"{file}: {key}: set exactly one of start_step, start_tokens, start_fraction")
        if len(stage.weights) != len(sources):
            raise DstrainError(
                f"{file}: {key}.weights has {len(stage.weights)} entries for {len(sources)} data.sources; "
                f"give one weight per source, in the order of data.sources"
            )
        if not any(w > 0 for w in stage.weights):
            raise DstrainError(f"{file}: {key}.weights are all 0; give at least one source a positive weight")
    starts = recipe.stage_starts()
    for i, ((before, _), (first, _)) in enumerate(zip(starts, starts[1:])):
        if not before < first < recipe.total_steps:
            raise DstrainError(
                f"{file}: data.stages[{i}] starts at step {first + 1}, which is not after the stage before "
                f"(step {before + 1}) and inside the run's {recipe.total_steps} steps; order the stages by start"
            )
