"""The ranks of `dstrain doctor`: every strategy's short run in one process group, then the kernel checks.

    deepspeed --num_gpus N --module dstrain.train.doctor.runs PLAN.json

PLAN.json (written by dstrain.commands.doctor) holds ``runs``, each ``{"name", "argv", "stop_after"}``: the trainer's
arguments (``python -m dstrain.train``'s) and, for the save-and-resume check, the step after which the run stops as on
a SIGUSR1 (it is then launched again with ``resume_argv``, under another layout, in the same run folder); and
``out``, where rank 0 writes ``codes.json`` (each run's exit status) and ``checks.json`` (dstrain.train.doctor.checks).
One launch for every strategy: the launcher and the imports cost once; each run builds and frees its own engine and
groups, as ``python -m dstrain.train`` would. A run that raises is recorded and the next one starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

from dstrain.train.doctor.probe import Probe
from dstrain.train.process import console


def run_folder(run: dict) -> Path:
    return Path(next(a.removeprefix("run_dir=") for a in run["argv"] if a.startswith("run_dir=")))


def stopping(probe: type[Probe], step: int) -> type[Probe]:
    """``probe`` that also stops the run as a SIGUSR1 after optimizer step ``step`` would (rank 0 sends it to
    itself: the trainer's stop is agreed across ranks at the step's end, then checkpointed)."""

    class StopAfter(probe):  # type: ignore[valid-type,misc]
        def stepped(self, taken: int) -> None:
            super().stepped(taken)
            if taken == step and int(os.environ.get("RANK", "0")) == 0:
                os.kill(os.getpid(), signal.SIGUSR1)

    return StopAfter


def run_one(run: dict, probe: type[Probe] = Probe) -> int:
    """One run of the plan under ``probe`` (a test's defect subclasses it); its exit status."""
    from dstrain.train.run import main

    folder = run_folder(run)
    try:
        if run.get("stop_after"):
            first = main(run["argv"], stopping(probe, run["stop_after"])(folder))  # a stop exits 0 once checkpointed
            return first or main(run["resume_argv"], probe(folder))
        return main(run["argv"], probe(folder))
    except Exception:  # noqa: BLE001  (one strategy's crash is that strategy's row; the next still runs)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "doctor_error.txt").write_text(traceback.format_exc())
        return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(args[-1]).read_text())
    out = Path(plan["out"])
    codes = {run["name"]: run_one(run) for run in plan["runs"]}
    from dstrain.train.doctor import checks as doctor_checks
    from dstrain.train.process import distributed

    distributed.init()
    checks = doctor_checks.run_checks(plan.get("checks", True))
    if distributed.rank() == 0:
        (out / "codes.json").write_text(json.dumps(codes, indent=1))
        (out / "checks.json").write_text(json.dumps(checks, indent=1))
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    console.start(False)
    sys.exit(main())
