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
    """The default demo names node1 at step 30, resumes from step 20 on the spare, and ends
    bit-identical; its --out is relative (like the default), yet the checkpoint it resumes from is
    named by an absolute path under the controller's checkpoint root."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "replicheck", "demo", "--yes", "--out", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=850,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads((out / "demo.json").read_text())
    inc = facts["incident"]
    assert inc["recommended_checkpoint"]["path"].startswith(str((out / "checkpoints").resolve()) + "/")
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


@pytest.mark.timeout(900)
def test_demo_serve_keeps_the_approval_page_up(tmp_path: Path) -> None:
    """`demo --serve` ends by serving the page and API over the demo's database, with a private
    operator token it made, until SIGTERM (exit 0)."""
    import re
    import signal
    import stat
    import time
    import urllib.request

    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicheck", "demo", "--yes", "--out", str(out), "--serve", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        deadline, seen, url = time.monotonic() + 800, [], None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"approval page: (http://\S+)/ ", line)
            url = m.group(1) if m else None
        assert url is not None, "".join(seen)[-3000:]
        token_file = out / "operator.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with urllib.request.urlopen(url + "/", timeout=30) as page:
            assert page.status == 200 and b"replicheck" in page.read().lower()
        request = urllib.request.Request(
            url + "/api/v1/incidents",
            headers={"Authorization": "Bearer " + token_file.read_text().strip()},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            listed = json.loads(reply.read())
        assert [(i["state"], i["nodes"]) for i in listed["incidents"]] == [("resumed", ["node1"])]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
