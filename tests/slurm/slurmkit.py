"""A throwaway Slurm cluster for tests: munged on a private socket, one slurmctld and N
``slurmd -N nodeX`` daemons on 127.0.0.1, each on a free port, and (with ``accounting``) job
accounting: a private MariaDB server (own datadir, socket and free port, run as the ``mysql``
user where it exists) behind a slurmdbd, so ``sacct`` shows what the jobs did. Only processes
started here are stopped (by their Popen handle / pid file), never by name."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "squeue")
ACCOUNTING_BINARIES = (
    "slurmdbd",
    "sacct",
    "sacctmgr",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "mariadb-admin",
)
DB_USER, DB_NAME = "slurm", "slurm_acct_db"
CLUSTER = "replicheck-test"


def missing_binaries(accounting: bool = False) -> list[str]:
    wanted = BINARIES + (ACCOUNTING_BINARIES if accounting else ())
    return [b for b in wanted if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


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

    def __init__(
        self, root: Path, nodes: int = 4, partition: str = "debug", accounting: bool = False
    ) -> None:
        self.root = root
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.partition = partition
        self.accounting = accounting
        self.conf = root / "slurm.conf"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.startup_s: dict[str, float] = {}
        """Seconds each start-up phase took (munge, database, slurmdbd, slurm)."""

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        r = self.root
        began = time.monotonic()
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
        self.startup_s["munge"] = time.monotonic() - began
        ports = free_ports(3 + len(self.nodes))
        self.conf.write_text(
            self._config(ports[0], ports[3:], dbd_port=ports[1] if self.accounting else None)
        )
        if self.accounting:
            began = time.monotonic()
            self._start_database(ports[2], timeout)
            self.startup_s["database"] = time.monotonic() - began
            began = time.monotonic()
            self._start_slurmdbd(ports[1], ports[2], timeout)
            self.startup_s["slurmdbd"] = time.monotonic() - began
        began = time.monotonic()
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self.scontrol("ping", check=False).returncode == 0, timeout, "slurmctld")
        for node in self.nodes:
            (r / "spool" / node).mkdir(exist_ok=True)
            self._spawn([_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self.wait_states({n: "idle" for n in self.nodes}, timeout)
        self.startup_s["slurm"] = time.monotonic() - began

    def _start_database(self, port: int, timeout: float) -> None:
        """A MariaDB server of our own: fresh datadir, private socket, 127.0.0.1:port only, and
        a ``slurm`` user with a random password that may use the accounting database only."""
        r = self.root
        user = "mysql" if _user_exists("mysql") else "root"  # mariadbd drops root to this user
        r.chmod(0o711)  # let that user reach its directories below the private root
        data, run = r / "mysql" / "data", r / "mysql" / "run"
        for d in (data, run):
            d.mkdir(parents=True)
            shutil.chown(d, user, user)
        self.db_socket = run / "mysqld.sock"
        common = ["--no-defaults", f"--user={user}", f"--datadir={data}"]
        small = ["--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"]
        self.run(
            _which("mariadb-install-db"),
            *common,
            *small,
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            timeout=timeout,
        )
        self._spawn(
            [
                _which("mariadbd"),
                *common,
                *small,
                f"--socket={self.db_socket}",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--innodb-flush-log-at-trx-commit=0",
                f"--pid-file={run / 'mysqld.pid'}",
                f"--log-error={run / 'mariadbd.log'}",
            ],
            "mariadbd",
        )
        ping = (_which("mariadb-admin"), f"--socket={self.db_socket}", "-uroot", "ping")
        self._wait(lambda: self.run(*ping, check=False).returncode == 0, timeout, "mariadbd")
        self.db_password = os.urandom(12).hex()
        sql = (
            f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.db_password}'; "
            f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1';"
        )
        self.run(_which("mariadb"), f"--socket={self.db_socket}", "-uroot", "-e", sql)

    def _start_slurmdbd(self, dbd_port: int, db_port: int, timeout: float) -> None:
        """slurmdbd reads slurmdbd.conf beside slurm.conf (SLURM_CONF); it must be 0600."""
        r = self.root
        conf = r / "slurmdbd.conf"
        conf.touch(mode=0o600)
        conf.write_text(
            "\n".join(
                [
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.socket}",
                    f"DbdHost={socket.gethostname()}",
                    "DbdAddr=127.0.0.1",
                    f"DbdPort={dbd_port}",
                    "SlurmUser=root",
                    f"PidFile={r / 'slurmdbd.pid'}",
                    f"LogFile={r / 'log' / 'slurmdbd.log'}",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",
                    f"StoragePort={db_port}",
                    f"StorageUser={DB_USER}",
                    f"StoragePass={self.db_password}",
                    f"StorageLoc={DB_NAME}",
                ]
            )
            + "\n"
        )
        self._spawn([_which("slurmdbd"), "-D"], "slurmdbd")
        sacctmgr = (_which("sacctmgr"), "--noheader", "--parsable2", "list", "cluster")
        self._wait(lambda: self.run(*sacctmgr, check=False).returncode == 0, timeout, "slurmdbd")
        # slurmctld only reports to a cluster the database knows.
        self.run(_which("sacctmgr"), "-i", "add", "cluster", CLUSTER)

    def sacct(self, job: str) -> dict[str, str]:
        """The accounting record of ``job``'s allocation (State, ExitCode, NodeList), as sacct shows it."""
        out = self.run(
            _which("sacct"),
            "-j",
            job,
            "-X",
            "--noheader",
            "--parsable2",
            "-o",
            "JobID,State,ExitCode,NodeList",
        ).stdout
        for line in out.splitlines():
            job_id, state, exit_code, nodes = line.split("|")
            if job_id == job:
                return {"State": state, "ExitCode": exit_code, "NodeList": nodes}
        return {}

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
        for f in sorted([*(self.root / "log").glob("*"), *(self.root / "mysql" / "run").glob("*.log")]):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def _config(self, ctl_port: int, node_ports: list[int], dbd_port: int | None) -> str:
        r, host = self.root, socket.gethostname()
        if dbd_port is None:
            accounting = ["AccountingStorageType=accounting_storage/none"]
        else:
            accounting = [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=127.0.0.1",
                f"AccountingStoragePort={dbd_port}",
                # The munge socket for talking to slurmdbd (AuthInfo covers slurmctld only).
                f"AccountingStoragePass={self.socket}",
            ]
        lines = [
            f"ClusterName={CLUSTER}",
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
            *accounting,
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

    def ended_job(self, *nodes: str, exit_code: int = 87, timeout: float = 30.0) -> str:
        """The id of a job that ran on ``nodes`` and exited with ``exit_code`` (87: a guarded job
        that detected corruption), once slurmctld shows it ended: the job an incident is about."""
        out = self.run(
            _which("sbatch"),
            "--parsable",
            f"-N{len(nodes)}",
            "-w",
            ",".join(nodes),
            "-o",
            "/dev/null",
            "--wrap",
            f"exit {exit_code}",
        ).stdout
        job = out.strip().split(";")[0]
        ended = "JobState=FAILED" if exit_code else "JobState=COMPLETED"
        self._wait(lambda: ended in self.scontrol("show", "job", job).stdout, timeout, f"job {job} to end")
        return job

    def running_job(self, node: str, timeout: float = 30.0) -> str:
        """The id of a job running (sleeping) on ``node``, once slurmctld shows it running; the
        caller cancels it (``scancel``)."""
        out = self.run(
            _which("sbatch"), "--parsable", "-N1", "-n1", "-w", node, "-o", "/dev/null", "--wrap", "sleep 600"
        ).stdout
        job = out.strip().split(";")[0]
        self._wait(
            lambda: "JobState=RUNNING" in self.scontrol("show", "job", job).stdout,
            timeout,
            f"job {job} to run",
        )
        return job

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
        """Every node back to idle with no ``Extra`` marker (after a test drained or failed some)
        and no replicheck maintenance reservation left over."""
        out = self.scontrol("show", "reservation", "--oneliner", check=False).stdout
        for name in re.findall(r"^ReservationName=(replicheck-\S+)", out, re.MULTILINE):
            self.scontrol("delete", f"reservation={name}", check=False)
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
