"""The CLI a new user meets: --version, bare command, read-only verbs, headers, pipes, logging."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from clikit import entry_point, replicheck
from ctlkit import cluster, make_incident

from replicheck.incident import write_incident


@pytest.mark.timeout(60)
def test_version_prints_the_installed_version() -> None:
    """`replicheck --version` prints the installed distribution's version and exits 0."""
    from importlib.metadata import version

    run = replicheck("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"replicheck {version('replicheck')}"


@pytest.mark.timeout(60)
def test_bare_command_prints_help_and_succeeds() -> None:
    """Bare `replicheck` prints the help (listing the commands) on stdout and exits 0."""
    run = replicheck()
    assert run.returncode == 0, run.stderr
    assert "usage: replicheck" in run.stdout and "incidents" in run.stdout and "--version" in run.stdout


@pytest.mark.timeout(60)
def test_read_only_verbs_create_nothing(tmp_path: Path) -> None:
    """incidents list/show, nodes and audit verify on a missing database exit 2 naming the path
    and create neither the database nor its directory (nor anything in the working directory)."""
    work = tmp_path / "work"
    work.mkdir()
    typo = tmp_path / "typo" / "x.db"
    for verb in (
        ("incidents", "list"),
        ("incidents", "list", "--rejected"),
        ("incidents", "show", "abc"),
        ("nodes",),
        ("nodes", "list"),
        ("audit", "verify"),
    ):
        run = replicheck(*verb, "--db", str(typo), cwd=work)
        assert run.returncode == 2, (verb, run.stdout, run.stderr)
        assert f"no controller database at {typo}" in run.stderr and "Traceback" not in run.stderr
        fresh = replicheck(*verb, cwd=work)  # the default ./replicheck-controller.db
        assert fresh.returncode == 2 and "replicheck-controller.db" in fresh.stderr, verb
    assert not typo.parent.exists()
    assert list(work.iterdir()) == []


@pytest.mark.timeout(60)
def test_incidents_list_has_a_header_row(tmp_path: Path) -> None:
    """`incidents list` starts with a header naming its columns, then one line per incident."""
    db = tmp_path / "c.db"
    cluster(db).close()
    inc = make_incident()
    assert (
        replicheck(
            "incidents", "ingest", str(write_incident(inc, tmp_path / "in")), "--db", str(db)
        ).returncode
        == 0
    )
    lines = replicheck("incidents", "list", "--db", str(db)).stdout.splitlines()
    assert lines[0].split()[:4] == ["INCIDENT", "STATE", "JOB", "NODES"]
    assert lines[1].startswith(inc.id) and len(lines) == 2


@pytest.mark.timeout(60)
def test_local_nodes_are_declared_through_the_cli(tmp_path: Path) -> None:
    """`nodes add` declares local nodes and spares in a fresh database, and with --job the job
    running on them (its allocation; a bad job id adds nothing); `nodes` lists them under a
    header; `controller run --apply --once` then cordons the suspect instead of 'unknown node'."""
    db = str(tmp_path / "c.db")
    empty = replicheck("nodes", "add", "--db", db, "--spare", "s1")
    assert empty.returncode == 0 and "s1: spare" in empty.stdout
    added = replicheck("nodes", "add", "n1", "n2", "--db", db, "--job", "job1")
    assert added.returncode == 0 and "job job1: runs on n1, n2" in added.stdout
    bad_job = replicheck("nodes", "add", "n3", "--db", db, "--job", "a b")
    assert bad_job.returncode == 2 and "not a job id" in bad_job.stderr
    bad = replicheck("nodes", "add", "n3", "--bad name", "--db", db)
    assert bad.returncode == 2 and "invalid node name" in bad.stderr
    listing = replicheck("nodes", "--db", db)
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "STATE", "PARTITIONS"]
    assert [line.split()[0] for line in lines[1:]] == ["n1", "n2", "s1"]  # n3 was not added
    assert replicheck("nodes", "list", "--db", db, "--json").returncode == 0
    inbox = tmp_path / "inbox"
    write_incident(make_incident(nodes=("n2",)), inbox)
    run = replicheck("controller", "run", "--db", db, "--watch", str(inbox), "--apply", "--once")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "detected -> cordoned" in run.stdout and "unknown node" not in run.stdout + run.stderr
    drained = {n["name"]: n["state"] for n in json.loads(replicheck("nodes", "--json", "--db", db).stdout)}
    assert drained == {"n1": "idle", "n2": "drained", "s1": "spare"}


@pytest.mark.timeout(60)
def test_empty_node_list_says_so(tmp_path: Path) -> None:
    """`nodes` on a database without declared nodes says how to declare them (stderr), exit 0."""
    db = tmp_path / "c.db"
    assert replicheck("nodes", "add", "x1", "--db", str(db)).returncode == 0
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM sim_nodes")
    run = replicheck("nodes", "--db", str(db))
    assert run.returncode == 0 and run.stdout == "" and "replicheck nodes add" in run.stderr


@pytest.mark.timeout(60)
def test_show_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """`incidents show ID | head -1` ends without a BrokenPipeError traceback."""
    db = tmp_path / "c.db"
    cluster(db).close()
    inc = make_incident()
    replicheck("incidents", "ingest", str(write_incident(inc, tmp_path / "in")), "--db", str(db))
    proc = subprocess.run(
        f"'{entry_point()}' incidents show {inc.id} --json --db '{db}' | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout == "{" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


@pytest.mark.timeout(60)
def test_logging_flags_and_json_format(tmp_path: Path) -> None:
    """-v turns on INFO lines on stderr; --log-format json makes each one a JSON object;
    --quiet hides them; without flags nothing but the command's output is printed."""
    f = str(write_incident(make_incident(), tmp_path / "in"))

    def ingest(*flags: str, db: str) -> subprocess.CompletedProcess[str]:
        cluster(tmp_path / db).close()
        return replicheck(*flags, "incidents", "ingest", f, "--db", str(tmp_path / db))

    plain = ingest(db="a.db")
    assert plain.returncode == 0 and plain.stderr == ""
    loud = ingest("-v", "--log-format", "json", db="b.db")
    records = [json.loads(line) for line in loud.stderr.splitlines()]
    assert records and all({"level", "logger", "message", "time"} <= r.keys() for r in records)
    assert any(r["level"] == "INFO" and r["logger"] == "replicheck.controller.controller" for r in records)
    assert ingest("--quiet", db="c.db").stderr == ""


@pytest.mark.timeout(120)
def test_progress_into_a_pipe_has_no_carriage_returns(tmp_path: Path) -> None:
    """With stderr a pipe, the progress is plain lines (no tqdm carriage-return frames)."""
    run = replicheck(
        "campaign",
        "--soak",
        "2",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--out",
        str(tmp_path / "o"),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\r" not in run.stderr and "soak: 1/1" in run.stderr
