"""benchmarks/noise_tables.py --tiny: the noise-table measurement runs, and writes every row it is
configured for in the documented format (so the script that chose the tolerant defaults cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "noise_tables.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import noise_tables as nt  # noqa: E402


@pytest.mark.timeout(120)
def test_tiny_run_writes_every_configured_row(tmp_path: Path) -> None:
    """--tiny writes noise-tables.json with one noise row per (precision, block, noise), one signal
    row per (precision, block, factor), a recommendation per precision, and the page beside it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "noise-tables.json").read_text())
    assert data["format"] == nt.FORMAT and data["mode"] == "tiny"
    assert set(data) == {"format", "mode", "config", "machine", "seconds", "summary"}
    assert tuple(data["config"]["precisions"]) == nt.TINY_PRECISIONS
    assert data["machine"]["torch"] and data["seconds"] > 0
    summary = data["summary"]
    pairs = data["config"]["pairs"]
    keys = [(r["precision"], r["block"], r["noise"]) for r in summary["noise"]]
    assert sorted(keys) == sorted((p, b, n) for p in nt.TINY_PRECISIONS for b in nt.BLOCKS for n in nt.NOISES)
    for r in summary["noise"]:
        assert r["pairs"] + r["nonfinite"] == pairs and 0 <= r["zero_fraction"] <= 1
        assert 0 <= r["q50"] <= r["q99"] <= r["q99_9"] <= r["max"] < 1, r
    keys = [(r["precision"], r["block"], r["factor"]) for r in summary["signal"]]
    assert sorted(keys) == sorted(
        (p, b, f) for p in nt.TINY_PRECISIONS for b in nt.BLOCKS for f in nt.FACTORS
    )
    assert all(0 < r["pairs"] <= pairs and 0 <= r["detected"] <= 1 for r in summary["signal"])
    for rec in summary["recommendation"].values():
        assert rec["block"] in nt.BLOCKS
        assert (
            rec["floor"] >= nt.SAFETY * rec["max_noise"] and rec["ceiling"] >= nt.CEILING_RATIO * rec["floor"]
        )
    assert set(summary["recommendation"]) == set(nt.TINY_PRECISIONS)
    page = (tmp_path / "noise-tables.md").read_text()
    for heading in ("## Method", "## Noise", "## Signal", "## Recommended tolerant defaults"):
        assert heading in page


def test_floors_are_rounded_up_to_two_digits() -> None:
    """A floor is rounded up (never down) to two significant digits, written exactly."""
    assert nt.nice_up(0.07625) == 0.077
    assert nt.nice_up(2.4e-5) == 2.4e-5
    assert nt.nice_up(5.99e-5) == 6e-5
    assert nt.nice_up(0.0) == 0.0
