"""Check a resolved ds_config against DeepSpeed's own config model before anything is written.

DeepSpeed parses its config only inside ``deepspeed.initialize``, after the process group started and the
run folder was claimed, and it ignores keys it does not know. Here the same parser (``DeepSpeedConfig``
and its pydantic sections) reads the config through a dict that records every key DeepSpeed asks for: a
key nobody asked for is a misspelling (DeepSpeed's code is the list of valid keys). Sections handed to a
pydantic model are checked by the model itself (``extra="forbid"``).
"""

from __future__ import annotations

import copy
import difflib
import logging
from typing import Any

from dstrain.errors import InputError

# Keys dstrain writes besides those DeepSpeed reads: DeepSpeed ignores a ds_config "seed"; strategy.resolve
# records the recipe's seed there (a pinned one must equal it). DeepSpeedConfig reads "sequence_parallel_size" only
# inside a process group (runtime/config.py), which this check runs without; strategy.resolve reads it. "tiling" is
# dstrain's own section (parallel.check_tiling checks it, dstrain.train.engine.tiling applies it).
DSTRAIN_KEYS = {"seed", "sequence_parallel_size", "tiling"}
# Handed whole to the optimizer's constructor (runtime/engine.py _configure_basic_optimizer), which checks them.
OPEN_SECTIONS = ("optimizer.params",)
# "pipeline": DeepSpeed's keys (runtime/config.py get_pipeline_config copies the whole section, so the
# recorder cannot see which it uses) and partition_method and schedule, which dstrain's engine.py reads.
PIPELINE_KEYS = {
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "partition_method",
    "schedule",
}


class _Recorder(dict):
    """A dict that records, in a list shared by all levels, every dotted key asked for, present or not."""

    def __init__(self, data: dict, asked: list, whole: set, where: str = ""):
        super().__init__({k: _wrap(v, asked, whole, f"{where}{k}.") for k, v in data.items()})
        self._asked, self._whole, self._where = asked, whole, where

    def _ask(self, key: Any) -> None:
        self._asked.append(f"{self._where}{key}")

    def __getitem__(self, key):
        self._ask(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._ask(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._ask(key)
        return super().__contains__(key)

    def _all(self):
        self._whole.add(self._where)

    def __iter__(self):
        self._all()
        return super().__iter__()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def __copy__(self):  # DeepSpeedConfig parses a copy.copy of the user's dict
        twin = _Recorder({}, self._asked, self._whole, self._where)
        dict.update(twin, dict.items(self))
        return twin

    def __deepcopy__(self, memo):
        self._all()
        return copy.deepcopy(dict(dict.items(self)), memo)


def _wrap(value: Any, asked: list, whole: set, where: str) -> Any:
    return _Recorder(value, asked, whole, where) if isinstance(value, dict) else value


def _paths(node: dict, where: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        out.append(f"{where}{key}")
        if isinstance(value, dict) and f"{where}{key}" not in OPEN_SECTIONS:
            out.extend(_paths(value, f"{where}{key}."))
    return out


def validate_ds_config(config: dict) -> None:
    """Raise a one-line InputError (the key and the fix; the check phase names the file) if DeepSpeed would reject
    ``config`` or ignore one of its keys."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    trial = copy.deepcopy(config)
    # strategy.resolve checked the batch arithmetic for the launch's world size; DeepSpeed would check it for the
    # world it sees here (one, or a process group of another test or command), so it derives the product instead.
    del trial["train_batch_size"]
    asked: list[str] = []
    whole: set[str] = set()
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        DeepSpeedConfig(_Recorder(trial, asked, whole))
    except ValidationError as e:
        raise InputError(_pydantic_line(e, asked, config)) from None
    except Exception as e:  # DeepSpeedConfigError, and the asserts and ValueErrors of its hand-written checks
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"DeepSpeed rejects this ds_config: {message}") from None
    finally:
        logger.setLevel(level)
    _check_unknown_keys(config, set(asked), whole)
    _check_optimizer(config)


def _check_unknown_keys(config: dict, asked: set, whole: set) -> None:
    for path in _paths(config):
        parent, _, key = path.rpartition(".")
        where = f"{parent}." if parent else ""
        if parent == "pipeline":
            known = {f"pipeline.{k}" for k in PIPELINE_KEYS}
        elif where and (any(where.startswith(w) for w in whole) or not any(k.startswith(where) for k in asked)):
            # Read whole, or handed to a pydantic model (which forbids unknown keys itself), not key by key.
            continue
        else:
            known = asked | DSTRAIN_KEYS
        if path in known:
            continue
        siblings = sorted({k[len(where) :] for k in known if k.startswith(where) and "." not in k[len(where) :]})
        close = difflib.get_close_matches(key, siblings, n=1)
        hint = f'did you mean "{where}{close[0]}"?' if close else "DeepSpeed does not read it; remove it"
        raise InputError(f'unknown key "{path}"; {hint}')


def _check_optimizer(config: dict) -> None:
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = str(config.get("optimizer", {}).get("type", "AdamW"))
    # The engine's rule (runtime/engine.py _configure_basic_optimizer): DeepSpeed's own, else torch.optim.<name>.
    torch_optimizers = [
        n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    ]
    if name.lower() in DEEPSPEED_OPTIMIZERS or name in torch_optimizers:
        return
    names = {n.lower(): n for n in [*DEEPSPEED_OPTIMIZERS, *torch_optimizers]}
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    hint = (
        f'did you mean "{names[close[0]]}"?'
        if close
        else f"use one of {', '.join(DEEPSPEED_OPTIMIZERS)} or a torch.optim class"
    )
    raise InputError(f'optimizer.type "{name}" is neither a DeepSpeed nor a torch.optim optimizer; {hint}')


def _pydantic_line(error, asked: list, config: dict) -> str:
    """One line for the first pydantic error, its location prefixed with the section DeepSpeed was reading."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    section = _section_of(loc, asked, config)
    path = ".".join([*section, *loc]) or "(top level)"
    if first["type"] == "extra_forbidden":
        model = _model_at(error.title, loc[:-1])
        close = difflib.get_close_matches(loc[-1], list(model.model_fields) if model else [], n=1)
        fix = f'did you mean "{".".join([*section, *loc[:-1], close[0]])}"?' if close else "remove it"
        return f'unknown key "{path}"; {fix}'
    given = first.get("input")
    shown = f" (got {given!r})" if not isinstance(given, dict) else ""
    return f'"{path}": {first["msg"]}{shown}'


def _section_of(loc: list[str], asked: list, config: dict) -> list[str]:
    """The section DeepSpeed read last that holds ``loc``: pydantic reports locations inside the section it parsed."""
    for path in reversed(asked):
        node: Any = config
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and loc and loc[0] in node:
            return path.split(".")
    return []


def _model_at(title: str, loc: list[str]):
    import typing

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    model = next((c for c in subclasses(DeepSpeedConfigModel) if c.__name__ == title), None)
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, DeepSpeedConfigModel)), None)
    return model
