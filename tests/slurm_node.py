"""A single-node SLURM for the tests: munged, slurmctld and slurmd from the system's packages,
configured in a temporary directory, this host being controller and only compute node.

Process tracking needs no cgroups (proctrack/linuxproc, task/none, no accounting), so it runs
inside a container as root. `LocalSlurm.start()` returns once `sinfo` shows the node idle; the
reason it cannot start (not root, a package missing, a daemon that exits) is raised as
SlurmUnavailable so that the fixture can skip with it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scancel", "scontrol")
INSTALL = "apt-get install -y slurm-wlm munge (as root)"


class SlurmUnavailable(RuntimeError):
    """Why a local SLURM cannot run here."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int, memory_mb: int, munge_socket: Path) -> str:
    """One controller and one node, both this host; ports picked free so two runs do not clash."""
    return "\n".join([
        "ClusterName=daskrl",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        # No cgroups in a container: track job processes through /proc, bind nothing.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        # Cores and memory are consumable: two one-core jobs run side by side on the node.
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none", "ReturnToService=2", "InactiveLimit=0",
        "KillWait=5",  # a cancelled job's processes get SIGKILL 5 s after SIGTERM (default 30)
        "SchedulerParameters=sched_interval=2",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    """Start and stop the daemons; `env` is what SLURM's client commands need (SLURM_CONF)."""

    def __init__(self, root: Path, cpus: int = 2, memory_mb: int = 4000):
        self.root, self.cpus, self.memory_mb = Path(root), cpus, memory_mb
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.processes: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def check(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("a local SLURM needs root (slurmd runs jobs as their user)")
        missing = [name for name in DAEMONS if shutil.which(name) is None]
        if missing:
            raise SlurmUnavailable(f"{', '.join(missing)} not installed; {INSTALL}")

    def start(self, timeout: float = 60.0) -> LocalSlurm:
        self.check()
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.conf.write_text(slurm_conf(self.root, self.host, self.cpus, self.memory_mb, self.munge_socket))
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], "slurmd")
        self._wait_idle(timeout)
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={self.root}/munge/munged.pid", f"--log-file={self.root}/munge/munged.log",
                     f"--seed-file={self.root}/munge/munged.seed"], "munged")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not open {self.munge_socket} within 10 s")
            time.sleep(0.1)

    def _spawn(self, command: list[str], name: str) -> None:
        log = open(self.root / f"{name}.stdout", "wb")
        self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               env={**os.environ, **self.env}))
        time.sleep(0.2)
        if self.processes[-1].poll() is not None:
            raise SlurmUnavailable(f"{name} exited at once: {self._tail(name)}")

    def _tail(self, name: str) -> str:
        for path in (self.root / f"{name}.log", self.root / f"{name}.stdout"):
            if path.exists() and path.read_text().strip():
                return path.read_text().strip().splitlines()[-1]
        return "(no log)"

    def sinfo_state(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                             env={**os.environ, **self.env}, timeout=10)
        return out.stdout.strip() or out.stderr.strip()

    def _wait_idle(self, timeout: float) -> None:
        deadline, state = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for process, name in zip(self.processes, ("munged", "slurmctld", "slurmd")):
                if process.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited: {self._tail(name)}")
            state = self.sinfo_state()
            if state == "idle":
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"the node was not idle within {timeout:.0f} s (sinfo: {state!r}; "
                               f"slurmd: {self._tail('slurmd')})")

    def stop(self) -> None:
        """Cancel what is left in the queue, then stop the daemons (slurmd, slurmctld, munged)."""
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "--partition", "debug"], capture_output=True,
                           env={**os.environ, **self.env}, timeout=10)
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
