"""The command line: incidents, nodes, controller run, selftest; and no torch in the controller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ctlkit import cluster, make_incident

from replicheck.incident import write_incident

SRC = Path(__file__).resolve().parents[2] / "src"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("REPLICHECK_DB", None)
    return subprocess.run(
        [sys.executable, "-m", "replicheck", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.timeout(60)
def test_controller_never_imports_torch() -> None:
    """Importing the controller package and running its CLI commands leaves torch unimported."""
    code = (
        "import sys, replicheck.controller, replicheck.controller.backends.slurm, replicheck.controller.wiring\n"
        "from replicheck.cli import build_parser, main\n"
        "build_parser()\n"
        "main(['incidents', 'list', '--db', sys.argv[1]])\n"
        "main(['nodes', '--db', sys.argv[1]])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('clean')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        run = subprocess.run(
            [sys.executable, "-c", code, os.path.join(d, "c.db")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("clean")


@pytest.mark.timeout(120)
def test_operator_workflow_through_cli(tmp_path: Path) -> None:
    """run --once cordons, incidents approve records the person, the next run replaces and resumes."""
    db = tmp_path / "c.db"
    cluster(db).close()
    inbox = tmp_path / "inbox"
    inc = make_incident()
    write_incident(inc, inbox)
    conf = tmp_path / "c.toml"
    conf.write_text('[controller]\ncheckpoint_roots = ["/ck"]\n')
    run = cli(
        "controller",
        "run",
        "--db",
        str(db),
        "--config",
        str(conf),
        "--watch",
        str(inbox),
        "--apply",
        "--once",
    )
    assert run.returncode == 0, run.stderr
    assert "detected -> cordoned" in run.stdout and "cordoned -> awaiting_approval" in run.stdout
    listing = cli("incidents", "list", "--db", str(db))
    assert inc.id in listing.stdout and "awaiting_approval" in listing.stdout
    approve = cli("incidents", "approve", inc.id, "--by", "alice", "--db", str(db))
    assert approve.returncode == 0 and "approved by alice" in approve.stdout
    run = cli("controller", "run", "--db", str(db), "--config", str(conf), "--apply", "--once")
    assert "replaced -> resumed" in run.stdout, run.stdout + run.stderr
    show = cli("incidents", "show", inc.id, "--json", "--db", str(db))
    data = json.loads(show.stdout)
    assert data["record"]["state"] == "resumed" and data["record"]["approved_by"] == "alice"
    assert any(a["actor"] == "alice" for a in data["audit"])
    nodes = cli("nodes", "--db", str(db))
    assert "Action:Replace" in nodes.stdout and "s1" in nodes.stdout


@pytest.mark.timeout(60)
def test_dry_run_is_the_default(tmp_path: Path) -> None:
    """controller run without --apply says dry-run and leaves every node as it was."""
    db = tmp_path / "c.db"
    cluster(db).close()
    incident_file = write_incident(make_incident(), tmp_path / "in")
    run = cli("controller", "run", "--db", str(db), "--incident", str(incident_file), "--once")
    assert run.returncode == 0 and "dry-run" in run.stdout
    nodes = cli("nodes", "--db", str(db), "--json")
    assert {n["state"] for n in json.loads(nodes.stdout) if n["name"].startswith("n")} == {"idle"}


@pytest.mark.timeout(60)
def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    """Unknown incident, malformed file and invalid config each give one error line and exit 2 or 1, no traceback."""
    db = str(tmp_path / "c.db")
    unknown = cli("incidents", "approve", "nope", "--by", "x", "--db", db)
    assert (
        unknown.returncode == 2
        and "no incident 'nope'" in unknown.stderr
        and "Traceback" not in unknown.stderr
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    ingest = cli("incidents", "ingest", str(bad), "--db", db)
    assert ingest.returncode == 1 and "rejected" in ingest.stderr and "Traceback" not in ingest.stderr
    rejected = cli("incidents", "list", "--rejected", "--db", db)
    assert "not valid JSON" in rejected.stdout
    conf = tmp_path / "c.toml"
    conf.write_text("[controller]\nmax_replacements = 'many'\n")
    run = cli("controller", "run", "--db", db, "--config", str(conf), "--once")
    assert run.returncode == 2 and "max_replacements must be a number" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.timeout(60)
def test_approve_in_wrong_state_is_refused(tmp_path: Path) -> None:
    """Approving an incident that is still being cordoned exits 2 and says which state it is in."""
    db = tmp_path / "c.db"
    cluster(db).close()
    incident_file = write_incident(make_incident(), tmp_path / "in")
    assert cli("incidents", "ingest", str(incident_file), "--db", str(db)).returncode == 0
    approve = cli("incidents", "approve", make_incident().id, "--by", "bob", "--db", str(db))
    assert approve.returncode == 2 and "is detected" in approve.stderr


@pytest.mark.timeout(120)
def test_selftest_fingerprint_is_reproducible() -> None:
    """Two runs of the known-answer self-test give the same fingerprint; --expect of another exits 1."""
    first = json.loads(cli("selftest", "--json", "--steps", "1").stdout)
    second = cli("selftest", "--json", "--steps", "1", "--expect", first["fingerprint"])
    assert second.returncode == 0 and json.loads(second.stdout)["passed"] is True, (first, second.stdout)
    wrong = cli("selftest", "--steps", "1", "--expect", "0" * 16)
    assert wrong.returncode == 1 and "DIFFERS" in wrong.stdout
