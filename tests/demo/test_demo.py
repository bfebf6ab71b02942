"""`replicheck demo` end to end, non-interactive, judged from its JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(900)
def test_demo_detects_replaces_resumes_and_loses_nothing(tmp_path: Path) -> None:
    """The default demo names node1 at step 30, resumes from step 20 on the spare, and ends bit-identical."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "replicheck", "demo", "--yes", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=850,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads((out / "demo.json").read_text())
    inc = facts["incident"]
    assert (inc["step"], inc["check"], inc["suspect_ranks"], inc["suspect_nodes"]) == (
        30,
        "replay",
        [1],
        ["node1"],
    )
    assert inc["recommended_checkpoint"]["step"] == 20
    states = [t["to"] for t in facts["transitions"]]
    assert states == [
        "cordoned",
        "triaging",
        "awaiting_approval",
        "approved",
        "replacing",
        "replaced",
        "resumed",
    ]
    assert facts["replacement"] == {"node1": "spare0"}
    assert facts["resumed_from"] == 20 and facts["final_step"] == 39
    assert facts["final_equal"] is True
    assert "approved automatically" in proc.stdout and "bit-for-bit identical" in proc.stdout
    assert (out / "incidents" / f"{inc['id']}.json").exists()


@pytest.mark.timeout(600)
def test_demo_scenario_reports_an_undetected_fault_honestly(tmp_path: Path) -> None:
    """`--scenario transient-unverified` raises no incident and says the weights differ from a clean run."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicheck",
            "demo",
            "--yes",
            "--scenario",
            "transient-unverified",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=550,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads((out / "demo.json").read_text())
    assert facts["detected"] is False and facts["final_equal"] is False
    assert "went undetected" in facts["summary"]
