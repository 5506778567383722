"""A real, private Slurm cluster on this machine for the Slurm tests (session-scoped fixture ``slurm_cluster``).

Debian's Slurm 22.05 (`slurmctld slurmd slurm-client munge`, which scripts/test installs as root)
runs as: one munged (as user munge, on its own socket and key), one slurmctld and one slurmd per
emulated node, all in the foreground as our children and stopped by PID at the end of the session.
Each emulated node has its own port, a loopback address (127.0.0.2, 127.0.0.3, ...) and a host
name in /etc/hosts, so that a 2-node job sees ``SLURM_JOB_NODELIST=dsnode[1-2]`` and its ranks
meet at a resolvable MASTER_ADDR. The /etc/hosts lines are added once if missing and left in place
(marked "# dstrain slurm test node"): removing them at the end would pull the names from under a
second test session running at the same time.
Config, state, spool and logs live in one temp folder; clients find it through ``SLURM_CONF``,
which ``cluster.env`` carries (and sbatch's default --export=ALL hands to the jobs).

Where the machine cannot run it (not root, packages missing) the fixture skips with the reason,
or fails under ``CI=true``.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

NODES = ("dsnode1", "dsnode2")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# dstrain slurm test node"
PACKAGES = "slurmctld slurmd slurm-client munge"
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel", "munged", "mungekey")
# Debian's layout when `slurmd -C` reports fewer than 2 CPUs: every test job needs 2 task slots on a node.
MIN_LAYOUT = "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1"


def unavailable(reason: str):
    """Skip (fail under CI=true, where the Slurm tests must run) because this machine cannot run Slurm."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Slurm tests cannot run under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_requirement() -> str | None:
    """Why this machine cannot host the test cluster, or None."""
    if not sys.platform.startswith("linux"):
        return f"the Slurm test cluster needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs jobs as their user; munged runs as user munge)"
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (
            f"Slurm is not installed ({', '.join(absent)} not found): run scripts/test as root, which installs "
            f"it, or `apt-get install -y {PACKAGES}`"
        )
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge package's user 'munge' does not exist; reinstall munge"
    if not os.access(HOSTS_FILE, os.W_OK):
        return f"{HOSTS_FILE} is not writable: the emulated nodes need host names"
    return None


def node_layout() -> str:
    """This machine's CPU layout as slurmd reports it (``CPUs=.. Boards=.. ...``), at least 2 CPUs."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    fields = dict(item.split("=", 1) for item in out.split())
    if int(fields.get("CPUs", "0")) < 2:
        return MIN_LAYOUT
    return " ".join(
        f"{k}={fields[k]}"
        for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if k in fields
    )


def _die_with_parent() -> None:
    """In a daemon's child process before exec: SIGTERM it when its parent (pytest) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SlurmCluster:
    """Daemons, config and client environment of one private cluster; ``start()`` then ``stop()``."""

    def __init__(self, base: Path, nodes=NODES):
        self.base = base
        self.nodes = list(nodes)
        self.addresses = {node: f"127.0.0.{i + 2}" for i, node in enumerate(self.nodes)}
        self.conf = base / "slurm.conf"
        self.logs = base / "log"
        self.munge_dir = base / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))]:
            if var != "SLURM_CONF":  # e.g. a test run from inside a Slurm job
                del self.env[var]

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        for sub in ("state", "spool", "run", "log"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)  # munged (user munge) must reach its folder inside
        self._add_hosts()
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(self._all_idle, 60, "nodes to come up idle")
        return self

    def stop(self) -> None:
        """Cancel what is left, stop our daemons by PID, then kill any process of this cluster still alive."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                if jobs:
                    self.run(["scancel", *jobs], check=False)
                    self._wait_for(
                        lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(),
                        30,
                        "cancelled jobs to leave",
                        fail=False,
                    )
        finally:
            # slurmds first, so that none is left reporting to a stopped controller; munged last.
            for name in sorted(self.procs, key=lambda n: (n == "munged", n == "slurmctld")):
                proc = self.procs[name]
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=10)
            self.procs.clear()
            self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """Kill what is left of this cluster's jobs (a job stuck past its cancellation, steps whose slurmd is
        gone): every process started under our slurm.conf, which the daemons, their slurmstepds and the jobs
        carry in their environment (sbatch exports it); the path is this session's own temp folder."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass  # gone meanwhile, or a kernel thread

    # --- clients ----------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        result = subprocess.run(cmd, env=kwargs.pop("env", self.env), capture_output=True, text=True, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None) -> int:
        """Submit; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd).stdout
        return int(out.strip().split(";")[0].split("_")[0])

    def job_state(self, job_id: int | str) -> str | None:
        """PENDING, RUNNING, COMPLETED, ... or None once the controller has forgotten the job (MinJobAge)."""
        result = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        states = re.findall(r"\bJobState=(\S+)", result.stdout)
        if result.returncode != 0 or not states:
            return None
        return states[0]

    def wait_gone(self, job_ids, timeout: float) -> None:
        """Wait until none of ``job_ids`` (array tasks included) is pending, running or completing."""
        ids = {str(j) for j in job_ids}

        def gone():
            out = self.run(["squeue", "-h", "-o", "%A %F %T"], check=False).stdout.split("\n")
            return not any(set(line.split()[:2]) & ids for line in out if line.strip())

        self._wait_for(gone, timeout, f"jobs {', '.join(sorted(ids))} to finish")

    # --- faults (tests/test_slurm.py's node-loss tests) -------------------------------------------------------------
    def job_processes(self, job_id: int, **environment: str) -> list[int]:
        """PIDs of this cluster's processes of job ``job_id`` whose environment has each of ``environment``'s values
        (e.g. SLURMD_NODENAME="dsnode2", SLURM_PROCID="1")."""
        wanted = {f"SLURM_CONF={self.conf}", f"SLURM_JOB_ID={job_id}", *(f"{k}={v}" for k, v in environment.items())}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                variables = {v.decode(errors="replace") for v in (entry / "environ").read_bytes().split(b"\0")}
            except OSError:
                continue
            if wanted <= variables:
                found.append(int(entry.name))
        return found

    def trainer_ranks(self, job_id: int, rank: int) -> list[int]:
        """The PIDs of rank ``rank`` of the job's current training step (python -m dstrain.train under srun)."""
        pids = []
        for pid in self.job_processes(job_id, SLURM_PROCID=str(rank)):
            try:
                if b"dstrain.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
            except OSError:
                pass
        return pids

    def kill_node(self, node: str, job_id: int) -> None:
        """As a node that dies: its slurmd, then the job's tasks on it and their slurmstepd, SIGKILLed."""
        self.procs[f"slurmd-{node}"].kill()
        self.procs[f"slurmd-{node}"].wait(timeout=10)
        for pid in self.job_processes(job_id, SLURMD_NODENAME=node):
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                is_stepd = Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"slurmstepd")
                os.kill(pid, signal.SIGKILL)
                if is_stepd:
                    os.kill(parent, signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile

    def restart_node(self, node: str) -> None:
        """A killed node's slurmd started again (ReturnToService=2 brings the node back when it registers)."""
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    def logs_tail(self, lines: int = 30) -> str:
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # --- internals ---------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = open(self.logs / f"{name}.out.log", "w")
        # Own session: a Ctrl-C on pytest reaches the teardown, not the daemons directly.
        # Own session: a Ctrl-C on pytest reaches the teardown, not the daemons directly; and should pytest
        # die without a teardown, the kernel stops the daemons (PR_SET_PDEATHSIG).
        self.procs[name] = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        log.close()
        time.sleep(0.2)
        if self.procs[name].poll() is not None:
            raise RuntimeError(f"{name} exited at once ({self.procs[name].returncode}):\n{self.logs_tail()}")

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir(exist_ok=True)
        key = self.munge_dir / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o755)  # clients must reach the socket; munged refuses a looser folder
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={self.munge_dir / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            user=munge.pw_uid,
            group=munge.pw_gid,
        )
        self._wait_for(self.munge_socket.exists, 20, "munged's socket")

    def _write_conf(self) -> None:
        from workers import free_port  # this xdist worker's block of ports

        b = self.base
        layout = node_layout()
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={self.addresses[n]} Port={free_port()} {layout} State=UNKNOWN" for n in self.nodes
        )
        self.conf.write_text(f"""\
ClusterName=dstraintest
# Job ids (and so the trainers' MASTER_PORT, 20000 + id) differ from another test session's.
FirstJobId={random.randrange(1000, 12000)}
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s).
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule every second (not every 30-60 s): a requeued job restarts as soon as cred_expire allows.
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# Refuse at submission a job no node can hold, instead of leaving it pending forever.
EnforcePartLimits=ALL
# Forget finished jobs quickly, so that `sbatch --wait` and our polling return soon after the end.
MinJobAge=5
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=10
MailProg=/bin/true
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _all_idle(self) -> bool:
        self._check_alive()
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _check_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"Slurm daemons exited: {dead}\n{self.logs_tail()}")

    def _wait_for(self, condition, timeout: float, what: str, fail: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.5)
        if fail:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs_tail()}")
        return False

    def _add_hosts(self) -> None:
        """Name the emulated nodes in /etc/hosts, once (appended in place: in containers it is often a bind mount)."""
        text = HOSTS_FILE.read_text()
        known = {name for line in text.splitlines() for name in line.split("#")[0].split()[1:]}
        missing = [f"{self.addresses[n]} {n} {HOSTS_MARK}" for n in self.nodes if n not in known]
        if missing:
            with open(HOSTS_FILE, "a") as f:
                f.write(("" if text.endswith("\n") or not text else "\n") + "\n".join(missing) + "\n")
        for node in self.nodes:
            if socket.gethostbyname(node) != self.addresses[node]:
                raise RuntimeError(
                    f"{node} resolves to {socket.gethostbyname(node)}, not {self.addresses[node]}: "
                    f"fix its line in {HOSTS_FILE}"
                )


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running 2-node cluster (``dsnode1``, ``dsnode2``) shared by the session; torn down at its end."""
    reason = missing_requirement()
    if reason:
        unavailable(reason)
    base = Path(tempfile.mkdtemp(prefix="dstrain-slurm-"))
    cluster = SlurmCluster(base)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
