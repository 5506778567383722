"""Numeric ranges declared with the field they constrain: ``log_interval: Annotated[int, Range(ge=1)] = 10``; and
``NonEmpty``, a string that "" cannot stand for (a path, a name): refused, never read as absent.

``config.parse`` checks every annotated value as it reads a recipe, so a value outside its range is one
line naming the file and the key, before any work (a 0 that would divide, a negative learning rate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None  # value <= le
    lt: float | None = None  # value < lt

    def contains(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        bounds = [
            f"{op} {bound:g}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " and ".join(bounds)


@dataclass(frozen=True)
class NonEmpty:
    fix: str  # what to write instead, for the one line that refuses ""


def check(value, ranges, key: str) -> str | None:
    """The problem with ``value`` under the ``Range`` and ``NonEmpty`` entries of ``ranges`` (Annotated metadata),
    or None."""
    for r in ranges:
        if isinstance(r, NonEmpty) and value == "":
            return f"{key} is empty; {r.fix}"
        if isinstance(r, Range) and not r.contains(value):
            return f"{key}={value!r} is out of range; it must be {r}"
    return None
