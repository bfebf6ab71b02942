"""The controller survives the world (issue 27): `controller run --http --watch` as a process
under a 1,024-descriptor limit with 1,100 idle connections, a database locked by another
process, and a full disk (a real tmpfs when this runs as root) — alive, answering /healthz, and
every incident written during the outage ingested once."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from httpkit import ALICE_TOKEN, call, cluster, make_incident, write_tokens

from replicheck.incident import write_incident

pytestmark = pytest.mark.timeout(180)

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    for key in ("REPLICHECK_DB", "REPLICHECK_JOB_TOKEN_FILE", "REPLICHECK_OPERATOR_TOKEN_FILE"):
        env.pop(key, None)
    return env


class Running:
    """`replicheck controller run --http 127.0.0.1:0 --watch DIR` in a subprocess."""

    def __init__(self, tmp: Path, db: Path, inbox: Path, config: str = "", nofile: int | None = None) -> None:
        job, operator = write_tokens(tmp)
        cfg = tmp / "ctl.toml"
        cfg.write_text("[controller]\nerror_backoff_max_s = 0.5\n" + config)
        self.log = (tmp / "ctl.log").open("w+")

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        args = ["controller", "run", "--db", str(db), "--config", str(cfg), "--watch", str(inbox)]
        args += ["--interval", "0.1", "--http", "127.0.0.1:0", "--operator-token-file", str(operator)]
        args += ["--job-token-file", str(job), "--header-timeout", "2"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "replicheck", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            preexec_fn=limit,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"approval page: (http://\S+)/ ", self.output())
            if m:
                self.url = m.group(1)
                return
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError("no URL printed:\n" + self.output())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthz(self) -> int:
        return call(self.url, "GET", "/healthz", timeout=10).status

    def incident_ids(self) -> list[str]:
        reply = call(self.url, "GET", "/api/v1/incidents", token=ALICE_TOKEN, timeout=10)
        assert reply.status == 200, reply.body
        return sorted(i["id"] for i in reply.json()["incidents"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
        self.log.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for r in started:
        r.stop()


def _wait(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _post_files(inbox: Path, first_step: int, count: int) -> list[str]:
    ids = []
    for step in range(first_step, first_step + count):
        incident = make_incident(job="world", step=step)
        write_incident(incident, inbox)
        ids.append(incident.id)
    return ids


def test_idle_connections_under_a_descriptor_limit(tmp_path: Path, running: list[Running]) -> None:
    """1,100 idle TCP connections against `controller run --http --watch` under `ulimit -n 1024`:
    the process stays alive, answers /healthz while they are held (an idle connection is closed to
    make room), ingests an incident file written meanwhile, and answers after they are gone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"this test opens 1,100 sockets itself; the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    db, inbox = tmp_path / "ctl.db", tmp_path / "inbox"
    inbox.mkdir()
    cluster(db)
    r = Running(tmp_path, db, inbox, nofile=1024)
    running.append(r)
    host, port = r.url.removeprefix("http://").rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        written = _post_files(inbox, 100, 1)
        assert r.alive(), r.output()
        assert r.healthz() == 200
        assert _wait(lambda: r.incident_ids() == written), r.output()
    finally:
        for s in idle:
            s.close()
    assert r.alive(), r.output()
    assert r.healthz() == 200
    assert "Too many open files" not in r.output()


@pytest.mark.parametrize(
    "held_s,config",
    [
        (3.0, "db_busy_timeout_s = 0.2\n"),
        # The case with the default 30 s busy timeout (the old code exited).
        pytest.param(33.0, "", marks=pytest.mark.slow),
    ],
)
def test_locked_database_survived(tmp_path: Path, running: list[Running], held_s: float, config: str) -> None:
    """Another process holds the database's write lock for longer than the busy timeout: the
    controller logs, backs off and retries; it stays alive, resumes after, and every incident file
    written during the lock is ingested exactly once."""
    db, inbox = tmp_path / "ctl.db", tmp_path / "inbox"
    inbox.mkdir()
    cluster(db)
    r = Running(tmp_path, db, inbox, config=config)
    running.append(r)
    before = _post_files(inbox, 1, 2)
    assert _wait(lambda: r.incident_ids() == sorted(before))
    holder = sqlite3.connect(db, isolation_level=None, timeout=30)
    holder.execute("BEGIN EXCLUSIVE")  # the write lock (in WAL mode readers still read)
    holder.execute("INSERT INTO meta(key, value) VALUES('lock-holder', 'test')")
    during = _post_files(inbox, 10, 5)
    time.sleep(held_s)
    assert r.alive(), r.output()
    holder.execute("ROLLBACK")
    holder.close()
    assert _wait(lambda: r.incident_ids() == sorted(before + during)), r.output()
    assert r.alive()
    assert r.healthz() == 200
    assert "database is locked" in r.output()  # logged, with the back-off
    with sqlite3.connect(db) as check:
        rows = check.execute("SELECT id, deliveries FROM incidents").fetchall()
    assert sorted(i for i, _ in rows) == sorted(before + during)
    assert all(n == 1 for _, n in rows)  # nothing ingested twice


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.skipif(not _can_mount(), reason="a real full disk needs a tmpfs mount (root)")
def test_full_disk_survived(tmp_path: Path, running: list[Running]) -> None:
    """The database lives on a 4 MiB tmpfs that is then filled to the last byte: the controller
    keeps running (passes fail with "disk is full", logged and backed off), and once space is freed
    every incident file written during the outage is ingested exactly once."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs failed here")
    try:
        db, inbox = mnt / "ctl.db", tmp_path / "inbox"
        inbox.mkdir()
        cluster(db)
        r = Running(tmp_path, db, inbox)
        running.append(r)
        before = _post_files(inbox, 1, 2)
        assert _wait(lambda: r.incident_ids() == sorted(before))
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            for chunk in (65536, 512, 1):  # to the last byte
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError:
                    pass
        finally:
            os.close(fd)
        during = _post_files(inbox, 10, 5)
        assert _wait(lambda: "full" in r.output(), timeout=20), r.output()
        time.sleep(1)
        assert r.alive(), r.output()
        filler.unlink()
        assert _wait(lambda: r.incident_ids() == sorted(before + during)), r.output()
        assert r.alive()
        assert r.healthz() == 200
        with sqlite3.connect(db) as check:
            rows = check.execute("SELECT id, deliveries FROM incidents").fetchall()
        assert sorted(i for i, _ in rows) == sorted(before + during)
        assert all(n == 1 for _, n in rows)
    finally:
        for started in running:
            started.stop()
        running.clear()
        subprocess.run(["umount", "-l", str(mnt)])


def test_second_controller_writes_nothing_before_the_lease(tmp_path: Path) -> None:
    """A second `controller run` on a database whose lease is held exits 2 before writing
    anything: not its settings, not a migration, not the local backend's tables."""
    from replicheck.controller.lease import Lease

    db = tmp_path / "ctl.db"
    held = Lease(db)
    held.acquire()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "replicheck", "controller", "run", "--db", str(db), "--once"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
    finally:
        held.release()
    assert done.returncode == 2, done.stderr
    assert "lease" in done.stderr
    assert not db.exists()  # nothing was written (on the old code: the settings, the schema)


def test_metrics_carry_the_last_pass(tmp_path: Path, running: list[Running]) -> None:
    """/metrics reports when the acting loop last completed a pass, and /healthz says it is recent."""
    db, inbox = tmp_path / "ctl.db", tmp_path / "inbox"
    inbox.mkdir()
    cluster(db)
    r = Running(tmp_path, db, inbox)
    running.append(r)
    assert _wait(
        lambda: b"replicheck_controller_last_pass_timestamp_seconds" in call(r.url, "GET", "/metrics").body
    )
    text = call(r.url, "GET", "/metrics").body.decode()
    value = float(
        re.search(r"^replicheck_controller_last_pass_timestamp_seconds (\S+)$", text, re.M).group(1)
    )  # type: ignore[union-attr]
    assert abs(value - time.time()) < 30
    health = json.loads(call(r.url, "GET", "/healthz").body)
    assert health["ok"] and health["loop"]["acting"] and health["loop"]["recent"]
