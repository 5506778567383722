"""Plain YAML (a recipe, an override, a recorded record) into typed dataclasses, with one line per error that names
the file, the dotted key and the fix. Hand-written rather than pydantic: the check is short, and we want those
one-line messages with the closest valid key."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from dstrain.errors import DstrainError
from dstrain.ranges import check


def read_yaml_file(path: Path, fix: str) -> Any:
    """A YAML file the user gave, or one line naming the file and what is wrong with it (``fix``: what to pass
    instead, e.g. "pass a recipe YAML file, e.g. recipes/tiny.yaml"). OSError is the caller's to word."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DstrainError(f"{path}: not a text file; {fix}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise DstrainError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None


def apply_override(raw: dict, item: str, path: Path) -> None:
    """Apply one dotted ``key=value`` override; the value is parsed as YAML (so 3e-4, true, [1, 2] work)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise DstrainError(f"override {item!r}: expected dotted key=value, e.g. train.steps=100")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise DstrainError(f"override {item!r}: {part} in {path} is not a section")
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise DstrainError(
            f"override {item!r}: {value!r} is not a YAML value ({getattr(e, 'problem', None) or type(e).__name__}); "
            f"check its brackets and quotes, "
            f"e.g. 'data.stages=[{{start_fraction: 0.5, weights: [0.5, 0.5]}}]'"
        ) from None


def parse(cls: type, data: Any, file: Path, where: str) -> Any:
    """Build dataclass ``cls`` from plain YAML data, checking keys and types.

    Hand-written rather than pydantic: the check is ~40 lines, and we want one-line
    messages that name the file, the dotted key and the closest valid key.
    """
    if not isinstance(data, dict):
        names = {f.name for f in dataclasses.fields(cls)}
        fix = f"; write it as `- path: {data}`" if "path" in names and isinstance(data, str) else ""
        raise DstrainError(
            f"{file}: {where.rstrip('.') or 'recipe'} must be a mapping, got {type(data).__name__} {data!r}{fix}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, include_extras=True)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {where}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            raise DstrainError(f"{file}: unknown key {where}{key}{hint}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = coerce(hints[name], data[name], file, f"{where}{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DstrainError(f"{file}: missing required key {where}{name}")
    try:
        return cls(**values)
    except DstrainError as e:  # checks in a config's __post_init__ name the key but not the file
        raise DstrainError(f"{file}: {e}") from None


def coerce(hint: Any, value: Any, file: Path, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:  # a declared Range (dstrain.ranges)
        value = coerce(args[0], value, file, key)
        problem = check(value, hint.__metadata__, key)
        if problem:
            raise DstrainError(f"{file}: {problem}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(inner, value, file, key)
    if origin is Literal:
        if value not in args:
            raise DstrainError(f"{file}: {key}={value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return parse(hint, value, file, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise DstrainError(f"{file}: {key} must be a mapping, got {value!r}")
        return {coerce(args[0], k, file, key): coerce(args[1], v, file, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise DstrainError(f"{file}: {key} must be a list, got {value!r}")
        if origin is tuple and len(value) != len(args):
            raise DstrainError(f"{file}: {key} must have {len(args)} items, got {len(value)}")
        items = [coerce(args[0] if origin is list else args[i], v, file, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise DstrainError(f"{file}: {key} must be {hint.__name__}, got {value!r}")
    return value
