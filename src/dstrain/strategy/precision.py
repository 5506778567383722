"""The precision a run trains in, as one type: what a ds_config's ``fp16`` / ``bf16`` switches select (neither: fp32).

A module of its own, below ``resolve`` and ``parallel`` (which imports nothing of ``resolve``), so every layer above
the base can name it.
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
