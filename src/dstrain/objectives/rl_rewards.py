"""The reward functions a recipe's ``rl.rewards`` names by import path, loaded before any work, and called with TRL's
signature: ``f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float]``, one float per completion,
``columns`` the prompt dataset's other columns (one value per completion). The step's reward is their weighted sum.

A function that raises, returns a NaN or a non-number, or the wrong count, stops the run in one line naming it and
the prompt (its index in the prompts dataset).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from dstrain.errors import DstrainError


@dataclass(frozen=True)
class Reward:
    path: str  # package.module:function, as the recipe names it
    weight: float
    function: Callable


def load_rewards(rewards, where: str = "rl.rewards") -> list[Reward]:
    """Each ``RewardConfig``'s function imported; a path that does not resolve is one line naming the recipe key."""
    loaded = []
    for i, reward in enumerate(rewards):
        key = f"{where}[{i}].function"
        module_name, _, name = reward.function.partition(":")
        if not module_name or not name:
            raise DstrainError(f"{key}: {reward.function!r} is not an import path; write package.module:function")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            why = f"{key}: cannot import {module_name} ({e})"
            raise DstrainError(f"{why}; put it on PYTHONPATH or fix the path") from None
        function = getattr(module, name, None)
        if not callable(function):
            raise DstrainError(f"{key}: {module_name} has no function {name}; fix the name after the ':'")
        loaded.append(Reward(reward.function, reward.weight, function))
    return loaded


def score(
    rewards: list[Reward],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    prompt_indices: list[int],
) -> list[list[float]]:
    """Each function's rewards of the completions (one list per function); ``prompt_indices``: each completion's
    prompt's index in the prompts dataset, named by a failure."""
    out = []
    for reward in rewards:
        values = _call(reward, prompts, completions, completion_ids, columns, prompt_indices)
        if not isinstance(values, list | tuple) or len(values) != len(completions):
            count = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise DstrainError(
                f"reward {reward.path} returned {count} values for {len(completions)} completions (prompts "
                f"{prompt_indices[0]}..{prompt_indices[-1]}); return one float per completion"
            )
        for value, index in zip(values, prompt_indices):
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise DstrainError(
                    f"reward {reward.path} returned {value!r} for a completion of prompt {index}; return a float, not "
                    f"NaN or None"
                )
        out.append([float(v) for v in values])
    return out


def _call(reward: Reward, prompts, completions, completion_ids, columns, prompt_indices):
    try:
        return reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as e:  # noqa: BLE001 - the user's code: find the prompt it fails on, say it in one line
        failing = _first_failing(reward, prompts, completions, completion_ids, columns, prompt_indices)
        raise DstrainError(f"reward {reward.path} raised {type(e).__name__}: {e} (on prompt {failing})") from None


def _first_failing(reward: Reward, prompts, completions, completion_ids, columns, prompt_indices) -> int | str:
    """The index of the first prompt whose completions alone make the function raise (else the step's range)."""
    for i in range(len(completions)):
        one = {name: values[i : i + 1] for name, values in columns.items()}
        try:
            reward.function(prompts=prompts[i : i + 1], completions=completions[i : i + 1],
                            completion_ids=completion_ids[i : i + 1], **one)  # fmt: skip
        except Exception:  # noqa: BLE001
            return prompt_indices[i]
    return f"{prompt_indices[0]}..{prompt_indices[-1]}, not alone"
