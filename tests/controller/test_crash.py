"""Crash safety: the controller is SIGKILLed right after each kind of backend call, and right
after each committed transition; a restart converges to the same end state with one replacement."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("crash_driver.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def drive(db: Path, point: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(DRIVER), str(db), *([point] if point else [])],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = drive(tmp_path_factory.mktemp("ref") / "c.db")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["state"] == "resumed" and summary["ops"]["replace"] == 1
    return summary


POINTS = [f"call:{k}" for k in ("cordon", "selftest", "uncordon", "replace", "await_return", "resume")] + [
    f"state:{s}"
    for s in ("cordoned", "triaging", "awaiting_approval", "approved", "replacing", "replaced", "resumed")
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", POINTS)
def test_killed_controller_converges_to_same_end_state(tmp_path: Path, reference: dict, point: str) -> None:
    """Killed (SIGKILL) at this point and restarted, the controller ends exactly as an uninterrupted run, with one replacement."""
    db = tmp_path / "c.db"
    killed = drive(db, point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    restarted = drive(db)
    assert restarted.returncode == 0, restarted.stderr
    summary = json.loads(restarted.stdout)
    assert summary == reference
    assert summary["ops"]["replace"] == 1 and len(summary["resumes"]) == 1
