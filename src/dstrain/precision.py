"""The precision a run trains in, as one type: what a ds_config's ``fp16`` / ``bf16`` switches select (neither: fp32).

A ground-floor module: the strategy, the metrics and the planner all name it, and it imports nothing.
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
