"""Fuzzing ingestion with a seeded generator of hostile incident files (fuzzkit.py): every input
is accepted exactly when the grammar allows it, or rejected with a reason; the reconcile loop
never raises; a valid incident beside hostile ones is always ingested and acted on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ctlkit import cluster, make_incident
from fuzzkit import generate

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.incident import write_incident

BATCH = 250


def fuzz(tmp_path: Path, seed: int, count: int) -> int:
    """Run ``count`` generated inputs through a watching controller; return how many ran."""
    cases = generate(seed, count)
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = tmp_path / "c.db"
    local = cluster(db, active=tuple(f"node{i}" for i in range(64)), spares=("s1", "s2"))
    config = ControllerConfig(apply=True, auto_approve=True, max_cordons=1000, max_replacements=0)
    checked = 0
    with Controller(db, backend=local, config=config) as ctl:
        for start in range(0, len(cases), BATCH):
            chunk = cases[start : start + BATCH]
            inbox = tmp_path / f"inbox{start}"
            inbox.mkdir()
            for i, case in enumerate(chunk):
                (inbox / f"c{i:05d}.json").write_bytes(case.content)
            beside = make_incident(job=f"valid{start}", nodes=("node1",))
            write_incident(beside, inbox)
            results = {Path(r.source).name: r for r in ctl.ingest_dir(inbox)}
            ctl.reconcile()  # acting on whatever was accepted must not raise either
            assert results[f"{beside.id}.json"].incident_id == beside.id
            assert ctl.store.get_record(beside.id).state is not State.DETECTED
            for i, case in enumerate(chunk):
                result = results[f"c{i:05d}.json"]
                if case.valid:
                    assert result.incident_id is not None, (case.what, result.rejected, case.content[:300])
                else:
                    assert result.incident_id is None, (case.what, case.content[:300])
                    assert result.rejected, case.what
                checked += 1
    return checked


@pytest.mark.timeout(240)
def test_fuzzed_inputs_are_accepted_or_rejected_never_crash(tmp_path: Path) -> None:
    """500+ generated hostile inputs: each accepted iff valid, else rejected with a reason; nothing raises."""
    assert fuzz(tmp_path, seed=13, count=600) >= 500


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_soak_five_thousand_inputs(tmp_path: Path) -> None:
    """5,000+ generated hostile inputs (slow set): the same property over more seeds."""
    started = time.monotonic()
    total = sum(fuzz(tmp_path / f"seed{seed}", seed=seed, count=1300) for seed in (1, 2, 3, 4))
    assert total >= 5000, total
    print(f"fuzzed {total} inputs in {time.monotonic() - started:.1f}s")
