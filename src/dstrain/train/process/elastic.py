"""A Slurm job that outlives a node: which hosts slurm/train.sbatch trains on next after a failed step, or a requeue.

The batch shell keeps its allocation when a node fails (``#SBATCH --no-kill``). After a training step that failed
(a rank exited non-zero, a node was lost, or the hang watchdog stopped every rank) the shell probes each host of the
allocation and asks ``python -m dstrain.train.process.elastic next``, which decides from this module's plain functions:

- a host that no longer answers, or whose rank the watchdog named (its hang/event.json lists the ranks behind), is
  left out; a spare node of the allocation takes its place, so the world size does not change; without a spare the
  world shrinks, and the global batch stays the recipe's (the accumulation grows: the resolved strategy says by how
  much, and refuses a global batch the smaller world cannot hold);
- no host lost: the same world restarts in place (a transient failure: an NCCL timeout, a killed process);
- past ``max_restarts`` relaunches in this job, below ``min_nodes`` healthy nodes, or a refused global batch: the job
  falls back to a requeue, as before these relaunches existed.

Each relaunch resumes from the newest intact checkpoint (dstrain.train's automatic resume reshards it onto the new
world). Every decision is one line in the job's log and an event the relaunched trainer logs at its first step
(dstrain.train.features.restart_event: metrics.jsonl and the dashboards), with the steps and seconds it cost;
``summary`` folds
them into summary.json. Torch-free: the batch shell runs it between steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dstrain.errors import DstrainError, OneLineArgumentParser
from dstrain.files import write_json_atomic

ELASTIC_DIR = "elastic"  # in the run folder: this module's state and events
STATE = "state.json"  # this job attempt's hosts, spares and relaunch count
PENDING = "pending.json"  # the latest decision, logged by the next launch's first step (RestartEvent)
EVENTS = "events.jsonl"  # every decision as logged, with the time it cost; folded into summary.json
HANG_EVENT = Path("hang") / "event.json"  # the watchdog's report of the last hang (dstrain.train.features.watchdog)


@dataclass(frozen=True)
class ElasticConfig:
    """slurm/train.sbatch's options for a failed step (``--spare-nodes``, ``--max-restarts``, ``--min-nodes``)."""

    spare_nodes: int = 0  # nodes of the allocation held back, each to replace a failed node
    max_restarts: int = 3  # relaunches inside one job (in place, with a spare, shrunk); past them, a requeue
    min_nodes: int = 1  # fewer healthy nodes than this: a requeue instead of a smaller world

    def check(self, nodes: int) -> None:
        """One line for an option the allocation of ``nodes`` nodes cannot honour, before any work."""
        if self.max_restarts < 0:
            raise DstrainError(f"train.sbatch: --max-restarts={self.max_restarts}; use 0 (requeue at once) or more")
        if self.spare_nodes < 0 or self.spare_nodes >= nodes:
            raise DstrainError(
                f"train.sbatch: --spare-nodes={self.spare_nodes} with {nodes} node(s) allocated leaves no node to "
                f"train on; use at most {nodes - 1} spare(s), or allocate more nodes (sbatch --nodes=...)"
            )
        if not 1 <= self.min_nodes <= nodes - self.spare_nodes:
            raise DstrainError(
                f"train.sbatch: --min-nodes={self.min_nodes} but {nodes - self.spare_nodes} node(s) train "
                f"({nodes} allocated, {self.spare_nodes} spare); use --min-nodes between 1 and "
                f"{nodes - self.spare_nodes}"
            )


@dataclass
class JobState:
    """One job attempt (a requeue starts a new one): where its ranks run and how often it relaunched."""

    job: str  # SLURM_JOB_ID and the attempt: "<id>.<SLURM_RESTART_COUNT>"
    gpus: int  # ranks per node
    hosts: list[str]  # the nodes training now, in rank order (block distribution: rank r on hosts[r // gpus])
    spares: list[str]  # healthy nodes held back
    excluded: list[str] = field(default_factory=list)  # nodes left out after a failure
    restarts: int = 0  # relaunches so far in this attempt
    world: int = 0  # ranks of the current launch

    def host_of_rank(self, rank: int) -> str | None:
        index = rank // self.gpus
        return self.hosts[index] if 0 <= index < len(self.hosts) else None


@dataclass(frozen=True)
class Decision:
    action: str  # "relaunch" or "requeue"
    kind: str  # the event: restart (in place), spare, shrink, requeue
    hosts: list[str]  # the nodes of the next launch (relaunch only)
    line: str  # what the job's log says, in one line
    details: dict  # the event's fields (lost hosts, world, accumulation, restart count)


def start(config: ElasticConfig, job: str, hosts: list[str], gpus: int) -> JobState:
    """The first launch of a job attempt: the last ``spare_nodes`` hosts held back."""
    config.check(len(hosts))
    train = hosts[: len(hosts) - config.spare_nodes]
    return JobState(job=job, gpus=gpus, hosts=train, spares=hosts[len(train) :], world=len(train) * gpus)


def decide(
    state: JobState, config: ElasticConfig, unreachable: set[str], hang_ranks: list[int], accumulation
) -> Decision:
    """After a failed step: the next launch's hosts, or a requeue. ``unreachable``: hosts the probe could not run on;
    ``hang_ranks``: the ranks the watchdog named; ``accumulation(world)``: the gradient accumulation the recipe's
    global batch needs on ``world`` ranks (a DstrainError: that world cannot hold it)."""
    named = {h for h in (state.host_of_rank(r) for r in hang_ranks) if h is not None}
    lost = [h for h in state.hosts if h in unreachable or h in named]
    why = {h: "unreachable" if h in unreachable else "named by the hang watchdog" for h in lost}
    spares = [h for h in state.spares if h not in unreachable]
    kept = [h for h in state.hosts if h not in lost]
    replaced = spares[: len(lost)]
    hosts = kept + replaced
    restart = state.restarts + 1
    details = {"lost": why, "restart": restart, "max_restarts": config.max_restarts, "world_before": state.world}
    lost_text = ", ".join(f"{h} ({reason})" for h, reason in why.items())
    if restart > config.max_restarts:
        return requeue(f"restart cap reached ({config.max_restarts} in this job)", lost_text, details)
    if len(hosts) < config.min_nodes:
        return requeue(
            f"{len(hosts)} healthy node(s) left, fewer than --min-nodes={config.min_nodes}", lost_text, details
        )
    world = len(hosts) * state.gpus
    try:
        accum = accumulation(world)
    except DstrainError as e:
        return requeue(f"{world} rank(s) cannot hold the global batch: {e}", lost_text, details)
    kind = "restart" if not lost else ("spare" if len(hosts) == len(state.hosts) else "shrink")
    details.update(hosts=hosts, spares_used=replaced, world=world, accumulation=accum)
    what = {
        "restart": "no node lost: restarting the same world in place",
        "spare": f"lost {lost_text}; spare {', '.join(replaced)} takes its place",
        "shrink": f"lost {lost_text}; excluded, continuing without",
    }[kind]
    line = (
        f"{what}: {len(hosts)} node(s) ({','.join(hosts)}), world {world}, accumulation {accum}, "
        f"restart {restart} of {config.max_restarts}, from the newest checkpoint"
    )
    return Decision("relaunch", kind, hosts, line, details)


def requeue(reason: str, lost_text: str, details: dict) -> Decision:
    line = (f"lost {lost_text}; " if lost_text else "") + f"{reason}: falling back to a requeue"
    return Decision("requeue", "requeue", [], line, {**details, "reason": reason})


# --- files of the run folder ----------------------------------------------------------------------------------------
def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / ELASTIC_DIR


def save_state(run_dir: str | Path, config: ElasticConfig, state: JobState) -> None:
    folder(run_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder(run_dir) / STATE, {"config": asdict(config), "state": asdict(state)})


def load_state(run_dir: str | Path) -> tuple[ElasticConfig, JobState]:
    saved = json.loads((folder(run_dir) / STATE).read_text())
    return ElasticConfig(**saved["config"]), JobState(**saved["state"])


def hang_ranks(run_dir: str | Path, since: float) -> list[int]:
    """The ranks the watchdog named in a report written after ``since`` (this launch's), else none."""
    report = Path(run_dir) / HANG_EVENT
    try:
        if report.stat().st_mtime < since:
            return []
        return [int(r) for r in json.loads(report.read_text()).get("ranks", [])]
    except (OSError, ValueError):
        return []


def last_step_logged(run_dir: str | Path) -> tuple[int, float]:
    """The last train record's step in metrics.jsonl and when it was written (the file's mtime): the last sign of
    progress before a fault, so the time a fault costs is counted from there."""
    metrics = Path(run_dir) / "metrics.jsonl"
    try:
        lines = metrics.read_text().splitlines()
        written = metrics.stat().st_mtime
    except OSError:
        return 0, time.time()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record and "split" not in record and "event" not in record:
            return int(record["step"]), written
    return 0, written


def record_pending(run_dir: str | Path, decision: Decision) -> None:
    """The decision as the event the next launch logs at its first step (dstrain.train.features.restart_event)."""
    fault_step, fault_time = last_step_logged(run_dir)
    event = {"event": decision.kind, **decision.details, "fault_step": fault_step, "fault_time": fault_time}
    event["detail"] = decision.line
    folder(run_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder(run_dir) / PENDING, event)


def fold_into_summary(run_dir: str | Path) -> None:
    """summary.json's "restarts": every event this run folder's launches logged (time and steps lost each)."""
    summary, events = Path(run_dir) / "summary.json", folder(run_dir) / EVENTS
    if not summary.is_file() or not events.is_file():
        return
    record = json.loads(summary.read_text())
    record["restarts"] = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    summary.write_text(json.dumps(record, indent=2) + "\n")


# --- the batch shell's commands -------------------------------------------------------------------------------------
def accumulation_of(recipe_file: str, ds_file: str, overrides: list[str]):
    """world -> the gradient accumulation the recipe's global batch needs under the ds_config (resolve's refusal
    when it cannot)."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, resolve

    recipe, ds_config = load_recipe_and_source(recipe_file, overrides)[0], load_ds_config(ds_file)
    return lambda world: resolve(recipe, recipe_file, ds_config, ds_file, world, False, validate=False).grad_accum


def command_start(args: argparse.Namespace) -> None:
    config = ElasticConfig(args.spare_nodes, args.max_restarts, args.min_nodes)
    state = start(config, args.job, args.hosts.split(","), args.gpus)
    accumulation_of(args.recipe, args.ds_config, args.overrides)(state.world)  # refused here, before any work
    save_state(args.run_dir, config, state)
    print(" ".join(state.hosts))


def command_next(args: argparse.Namespace) -> None:
    config, state = load_state(args.run_dir)
    unreachable = set(args.unreachable.split())
    named = hang_ranks(args.run_dir, args.since)
    decision = decide(state, config, unreachable, named, accumulation_of(args.recipe, args.ds_config, args.overrides))
    print(f"train.sbatch: {decision.line}", file=sys.stderr, flush=True)
    record_pending(args.run_dir, decision)
    if decision.action == "relaunch":
        lost = set(decision.details["lost"])
        state.excluded += sorted(lost)
        state.spares = [h for h in state.spares if h not in decision.hosts and h not in unreachable]
        state.hosts, state.world, state.restarts = decision.hosts, decision.details["world"], state.restarts + 1
        save_state(args.run_dir, config, state)
    print(decision.action, *decision.hosts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m dstrain.train.process.elastic", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    first = commands.add_parser("start", help="the first launch's hosts of this job attempt (checks the options)")
    first.add_argument("--job", required=True)
    first.add_argument("--gpus", type=int, required=True)
    first.add_argument("--spare-nodes", type=int, default=0)
    first.add_argument("--max-restarts", type=int, default=3)
    first.add_argument("--min-nodes", type=int, default=1)
    first.add_argument("--hosts", required=True, help="the allocation's nodes, comma-separated, in order")
    after = commands.add_parser("next", help="after a failed step: 'relaunch HOST...' or 'requeue'")
    after.add_argument("--unreachable", default="", help="hosts the probe could not run on, space-separated")
    after.add_argument("--since", type=float, default=0.0, help="the failed launch's start (epoch s)")
    commands.add_parser("summary", help="fold the events into summary.json")
    for command in (first, after):
        command.add_argument("--recipe", required=True)
        command.add_argument("--ds-config", required=True)
        command.add_argument("overrides", nargs="*")
    for command in commands.choices.values():
        command.add_argument("--run-dir", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        {"start": command_start, "next": command_next, "summary": lambda a: fold_into_summary(a.run_dir)}[args.command](
            args
        )
    except DstrainError as e:
        message = str(e)
        print(message if message.startswith("train.sbatch") else f"train.sbatch: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
