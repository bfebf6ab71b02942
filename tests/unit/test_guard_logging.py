"""The library's log lines (issue 12 items 5-6): silent by default, INFO per verification,
WARNING per fallback, the incident at ERROR, and a short human summary of a detection."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replicheck.elastic import summary
from replicheck.guard import CorruptionDetected, Guard, GuardConfig, current_pass
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

TINY = DecoderConfig(vocab=32, d_model=8, n_layers=1, n_heads=2, seq_len=4)


def test_library_prints_nothing_by_default() -> None:
    """Importing replicheck and logging a warning through its loggers prints nothing (NullHandler)."""
    code = (
        "import logging, replicheck\n"
        "logging.getLogger('replicheck.guard.step.guard').warning('fallback')\n"
        "logging.getLogger('replicheck.guard.runtime').error('incident')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "" and run.stderr == ""


def test_verification_lines_fallback_warning_and_incident_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One INFO line per verified step, a WARNING when exact mode runs without deterministic
    kernels, and the written incident at ERROR."""
    caplog.set_level(logging.INFO, logger="replicheck")
    model = make_model(TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = GuardConfig(verify_every=2, deterministic=False, incident_dir=str(tmp_path), job_id="j")
    guard = Guard(model, opt, lm_loss, config=cfg, node="solo")
    assert any(r.levelno == logging.WARNING and "deterministic" in r.getMessage() for r in caplog.records)
    for s in range(4):
        guard.step(synthetic_batch(TINY, step=s, rank=0, batch=4))
    verified = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "verified" in r.getMessage()
    ]
    assert verified == ["step 0 verified (replay) on rank 0", "step 2 verified (replay) on rank 0"]
    model.blocks[0].ffn.register_forward_hook(lambda m, i, o: o + 1.0 if current_pass() == "probe" else None)
    with pytest.raises(CorruptionDetected) as err:
        guard.step(synthetic_batch(TINY, step=4, rank=0, batch=4))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(err.value.incident.id in m and str(tmp_path) in m for m in errors)


def test_human_summary_says_what_where_and_next() -> None:
    """The summary names the step, the check, the suspect rank and node, the incident and what happens next."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
    from ctlkit import make_incident

    text = summary(make_incident(nodes=("n2",)), incident_path="/shared/inc/job1-s40-replay.json")
    assert "SILENT DATA CORRUPTION detected at step 40 (check replay, persistent)" in text
    assert "rank 0 on n2" in text and "job1-s40-replay" in text and "/shared/inc/" in text
    assert "exits with code 87" in text and "checkpoint step 30" in text and len(text.splitlines()) <= 6


def test_the_summary_of_a_no_restart_incident_says_the_others_go_on() -> None:
    """An incident whose continuation is no_restart (a torchft replica group leaves) says that the
    named group exits 87 while the others go on and a replacement group joins, not that the job
    exits and resumes from a checkpoint."""
    import dataclasses

    sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
    from ctlkit import make_incident

    from replicheck.incident import Continuation

    incident = dataclasses.replace(
        make_incident(nodes=("group1",)), continuation=Continuation(mode="no_restart", replica_group="group1")
    )
    text = summary(incident)
    assert "replica group group1 exits with code 87 and the other groups go on without it" in text
    assert "replacement group that joins live" in text
    assert "resumes" not in text and "checkpoint step" not in text
