"""How a command resolves an option it was given, or not: the value given, else the next source's, else the
declared default. Zero is a value (design.md invariant 15): an option given as 0, "" or false is used as given,
never replaced, so a command resolves with ``given(...)`` and not ``args.x or default``
(tests/test_zero_values.py checks both the options and that no command writes the latter)."""

from __future__ import annotations

import dataclasses
from typing import Any


def given(*values: Any) -> Any:
    """The first value that is not None (an absent option, a source that has none): 0, "" and False count."""
    return next(v for v in values if v is not None)


def declared_default(cls: type, name: str) -> Any:
    """The default a typed config declares for ``name``, so a command without a recipe falls back to the recipe's."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)
