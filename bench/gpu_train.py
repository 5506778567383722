"""`python -m dstrain.train` for bench/gpu_check.py's measurements, without the final checkpoint.

A measurement reads metrics.jsonl and deletes the run folder; the final checkpoint it would write first is 18 GB
for gpt-1.3b (about 20 s of a 7-minute loan, per run). Everything else is the trainer as users run it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from dstrain.train import run
    from dstrain.train.loop import Trainer

    Trainer.save = lambda self, background=False: None  # type: ignore[method-assign]
    sys.exit(run.main(sys.argv[1:]))
