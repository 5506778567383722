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
import time
import traceback
from datetime import timedelta
from pathlib import Path

from dstrain.train.doctor.probe import NudgedProbe, Probe
from dstrain.train.process import console

STORE_TIMEOUT_S = 3600  # a run's longest wait at the meeting (the launch itself is bounded by the command)


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
        # beside the run folder, not in it: a rank that reaches the run later must find it as the trainer left it
        errors = folder.parent.parent / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"{run['name']}.rank{os.environ.get('RANK', '0')}.txt").write_text(traceback.format_exc())
        return 1


class Between:
    """The ranks meet between two runs on a TCPStore of their own (DSTRAIN_DOCTOR_PORT, set by the command), which
    outlives each run's process group: a run that fails on one rank leaves the others in a collective until the
    collective timeout, and without this meeting the failed rank would start the next run alone and break it too.
    Each rank's exit status of each run goes through it to rank 0 (a run failed if it failed on any rank)."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore

        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        port = int(os.environ["DSTRAIN_DOCTOR_PORT"])
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.store = TCPStore(host, port, self.world, self.rank == 0, timedelta(seconds=STORE_TIMEOUT_S))

    def after(self, index: int, code: int) -> int:
        """Wait for every rank to end run ``index``; the worst exit status of its ranks (after a failure, every rank
        also takes the same new MASTER_PORT for the next run's process group)."""
        from dstrain.train.process.distributed import free_port

        self.store.set(f"code/{index}/{self.rank}", str(code))
        if self.rank == 0:  # a new rendezvous port, used after a failure: the old one's store may hold the old group
            self.store.set(f"port/{index}", str(free_port()))
        self.wait(f"done/{index}")
        codes = [int(self.store.get(f"code/{index}/{r}")) for r in range(self.world)]
        port = self.store.get(f"port/{index}").decode()
        self.store.add(f"read/{index}", 1)  # a rank's last call of the meeting: rank 0, which holds the store,
        if self.rank == 0:  # leaves only once every rank has made it
            self.wait(f"read/{index}", added=True)
        worst = next((c for c in codes if c != 0), 0)
        if worst:
            os.environ["MASTER_PORT"] = port
        return worst

    def wait(self, key: str, added: bool = False) -> None:
        if not added:
            self.store.add(key, 1)
        while int(self.store.add(key, 0)) < self.world:
            time.sleep(0.1)


def bound_deepspeeds_groups() -> None:
    """DeepSpeed creates its groups (data-, sequence-, model-parallel) without a timeout, and torch gives such a group
    its module default, 30 minutes, not the default group's: a rank left in one of them by a rank that failed alone
    (sp2_zero1_bf16's norm all-reduce on 2 CPU ranks) waited that long. In the doctor's ranks they get the trainer's
    collective timeout too."""
    import torch.distributed.distributed_c10d as c10d

    if "DSTRAIN_COLLECTIVE_TIMEOUT_S" in os.environ:
        c10d.default_pg_timeout = timedelta(seconds=int(os.environ["DSTRAIN_COLLECTIVE_TIMEOUT_S"]))


def run_all(runs: list[dict], probes: dict[str, type[Probe]] | None = None) -> dict[str, int]:
    """Every run in turn, the ranks meeting between runs (Between) where the command set them a store; each run under
    its probe (``probes``: a test's defects by run name; the doctor's own Probe otherwise)."""
    from dstrain.train.process import distributed

    bound_deepspeeds_groups()
    between = Between() if "DSTRAIN_DOCTOR_PORT" in os.environ else None
    codes = {}
    for index, run in enumerate(runs):
        default = NudgedProbe if run.get("nudge") else Probe
        code = run_one(run, (probes or {}).get(run["name"], default))
        codes[run["name"]] = between.after(index, code) if between else code
        if codes[run["name"]]:  # the runs share one process group; after a failure it may be broken: a new one
            distributed.shutdown()
    return codes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(args[-1]).read_text())
    out = Path(plan["out"])
    codes = run_all(plan["runs"])
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
