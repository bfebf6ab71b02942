"""`demo --out` never deletes what it did not create; `controller run` says what it deferred,
fails loudly, and validates its paths."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from clikit import replicheck
from ctlkit import cluster, make_incident

from replicheck.incident import write_incident


@pytest.mark.timeout(120)
def test_demo_bad_scenario_is_one_line_and_deletes_nothing(tmp_path: Path) -> None:
    """`demo --scenario nope --out DIR` exits 2 with one line naming the known scenarios and
    leaves DIR and the unrelated file in it untouched."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    run = replicheck("demo", "--yes", "--scenario", "nope", "--out", str(out))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "nope" in run.stderr and "aws-" in run.stderr
    assert (out / "thesis.tex").read_text() == "precious" and sorted(p.name for p in out.iterdir()) == [
        "thesis.tex"
    ]


@pytest.mark.timeout(120)
def test_demo_refuses_a_non_empty_foreign_directory(tmp_path: Path) -> None:
    """`demo --out .` in a working directory with files in it is refused (exit 2) and deletes nothing."""
    (tmp_path / "notes.txt").write_text("keep")
    run = replicheck("demo", "--yes", "--out", ".", cwd=tmp_path)
    assert run.returncode == 2 and "not empty" in run.stderr and "Traceback" not in run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_demo_clears_only_what_an_earlier_demo_created(tmp_path: Path) -> None:
    """Reusing a demo's directory removes what that demo recorded as created, keeps the rest."""
    from replicheck.demo import MARKER, _claim_out_dir, _seal_out_dir

    out = tmp_path / "demo-out"
    _claim_out_dir(out)
    (out / "incidents").mkdir()
    (out / "demo.json").write_text("{}")
    _seal_out_dir(out)
    (out / "added-later.txt").write_text("by hand")
    _claim_out_dir(out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "added-later.txt"]
    assert json.loads((out / MARKER).read_text()) == {"found": ["added-later.txt"], "created": None}


def _deferred_cordon(tmp_path: Path) -> tuple[str, str]:
    db = tmp_path / "c.db"
    cluster(db).close()
    f = write_incident(make_incident(), tmp_path / "in")
    dry = replicheck("controller", "run", "--db", str(db), "--incident", str(f), "--once")
    assert dry.returncode == 0 and "dry-run" in dry.stdout
    return str(db), dry.stdout


@pytest.mark.timeout(120)
def test_dry_run_says_what_it_deferred_and_apply_acts_at_once(tmp_path: Path) -> None:
    """A dry run prints each deferred action and until when; `run --apply --once` right after
    it performs the cordon instead of silently waiting out the dry run's deferral."""
    db, dry = _deferred_cordon(tmp_path)
    assert "deferred:" in dry and "cordon n2 until 20" in dry
    applied = replicheck("controller", "run", "--db", db, "--apply", "--once")
    assert applied.returncode == 0, applied.stderr
    assert "detected -> cordoned" in applied.stdout
    nodes = {n["name"]: n["state"] for n in json.loads(replicheck("nodes", "--json", "--db", db).stdout)}
    assert nodes["n2"] == "drained"


@pytest.mark.timeout(120)
def test_failed_incident_exits_non_zero(tmp_path: Path) -> None:
    """An incident that ends `failed` during `controller run` makes it exit 1 and name it."""
    db = tmp_path / "c.db"
    cluster(db).close()
    with sqlite3.connect(db) as conn:  # the suspect was never declared: cordoning it fails
        conn.execute("DELETE FROM sim_nodes WHERE name='n2'")
    inc = make_incident()
    f = write_incident(inc, tmp_path / "in")
    run = replicheck("controller", "run", "--db", str(db), "--incident", str(f), "--apply", "--once")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "-> failed" in run.stdout and f"failed: {inc.id}" in run.stdout


@pytest.mark.timeout(60)
def test_controller_run_validates_paths(tmp_path: Path) -> None:
    """`--watch` of a missing directory and `--incident` of a missing file exit 2 with one line."""
    db = str(tmp_path / "c.db")
    watch = replicheck("controller", "run", "--db", db, "--watch", "/does-not-exist", "--once")
    assert watch.returncode == 2 and "--watch /does-not-exist: no such directory" in watch.stderr
    inc = replicheck("controller", "run", "--db", db, "--incident", str(tmp_path / "nope.json"), "--once")
    assert inc.returncode == 2 and "no such file" in inc.stderr
