"""A throwaway Slurm cluster for tests: munged on a private socket, one slurmctld and N
``slurmd -N nodeX`` daemons on 127.0.0.1, each on a free port. Only processes started here
are stopped (by their Popen handle / pid file), never by name."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "squeue")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`. ``env`` is what clients need."""

    def __init__(self, root: Path, nodes: int = 4, partition: str = "debug") -> None:
        self.root = root
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.partition = partition
        self.conf = root / "slurm.conf"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o755)  # munged refuses a socket directory others can write to
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.socket = r / "munge" / "munge.socket"
        self._spawn(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
            "munged",
        )
        self._wait(lambda: self.socket.exists(), timeout, "munged socket")
        ports = free_ports(1 + len(self.nodes))
        self.conf.write_text(self._config(ports[0], ports[1:]))
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self.scontrol("ping", check=False).returncode == 0, timeout, "slurmctld")
        for node in self.nodes:
            (r / "spool" / node).mkdir(exist_ok=True)
            self._spawn([_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self.wait_states({n: "idle" for n in self.nodes}, timeout)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self._procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def _spawn(self, argv: Sequence[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        (self.root / f"{name}.popen.pid").write_text(str(proc.pid))
        self._procs.append(proc)

    def stop_controller(self) -> None:
        """Stop slurmctld only (to test an unreachable scheduler)."""
        for proc in self._procs:
            if proc.args[0].endswith("slurmctld") and proc.poll() is None:  # type: ignore[index]
                proc.send_signal(signal.SIGTERM)
                proc.wait(10)

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def _config(self, ctl_port: int, node_ports: list[int]) -> str:
        r, host = self.root, socket.gethostname()
        lines = [
            "ClusterName=replicheck-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=2",
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "Waittime=0",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 "
                "RealMemory=256 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        return "\n".join(lines) + "\n"

    # --- client helpers ---------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(_which("scontrol"), *args, check=check)

    def node_states(self) -> dict[str, tuple[str, str]]:
        out = self.run(_which("sinfo"), "--noheader", "--Node", "--format", "%N|%T|%E").stdout
        states = {}
        for line in out.splitlines():
            name, state, reason = line.split("|", 2)
            states[name.strip()] = (state.strip(), reason.strip())
        return states

    def wait_states(self, wanted: dict[str, str], timeout: float = 30.0) -> dict[str, tuple[str, str]]:
        """Poll until each node shows the wanted state word (e.g. idle* does not count as idle)."""
        last: dict[str, tuple[str, str]] = {}

        def ok() -> bool:
            nonlocal last
            last = self.node_states()
            return all(last.get(n, ("", ""))[0] == s for n, s in wanted.items())

        self._wait(ok, timeout, f"node states {wanted} (last: {last})")
        return last

    def reset_nodes(self) -> None:
        """Every node back to idle with no ``Extra`` marker (after a test drained or failed some)."""
        for name, (state, _) in self.node_states().items():
            if state != "idle":
                self.scontrol("update", f"nodename={name}", "state=resume", check=False)
            self.scontrol("update", f"nodename={name}", "extra=", check=False)
        self.wait_states({n: "idle" for n in self.nodes})

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}\n"
                        f"{self.logs()}"
                    )
            try:
                if cond():
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what}\n{self.logs()}")
