"""`replicheck selftest`: default devices, a report per device, distinct exit codes for a mismatch
and for a test that could not run, and a validated --expect (issue 12 item 12)."""

from __future__ import annotations

import json

import pytest
import torch
from clikit import replicheck


@pytest.mark.timeout(120)
def test_default_is_the_nodes_devices_with_a_report_each() -> None:
    """Without --device the test runs on every GPU (here, without CUDA: the CPU) and reports per device."""
    run = replicheck("selftest", "--steps", "1", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    expected = (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    )
    assert [d["device"] for d in data["devices"]] == expected
    assert all(d["fingerprint"] == data["fingerprint"] for d in data["devices"]) and data["status"] == "ok"


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the could-not-run path of a machine without CUDA"
)
def test_missing_device_could_not_run_exit_3_not_a_mismatch() -> None:
    """--device cuda without CUDA: one line per device saying it could not run, exit 3, no traceback."""
    run = replicheck("selftest", "--steps", "1", "--device", "cuda")
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "cuda could not run: CUDA is not available" in run.stdout
    both = replicheck("selftest", "--steps", "1", "--device", "cpu", "--device", "cuda", "--json")
    data = json.loads(both.stdout)
    assert both.returncode == 3 and data["status"] == "could not run" and data["passed"] is None
    assert [("fingerprint" in d, "error" in d) for d in data["devices"]] == [(True, False), (False, True)]


@pytest.mark.timeout(120)
def test_expect_is_validated_and_a_mismatch_exits_1() -> None:
    """--expect zz is a usage error (exit 2); a well-formed different fingerprint exits 1 (mismatch)."""
    bad = replicheck("selftest", "--steps", "1", "--expect", "zz")
    assert bad.returncode == 2 and "16 hex digits" in bad.stderr
    wrong = replicheck("selftest", "--steps", "1", "--device", "cpu", "--expect", "0" * 16, "--json")
    assert wrong.returncode == 1 and json.loads(wrong.stdout)["passed"] is False
