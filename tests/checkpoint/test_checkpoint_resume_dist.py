"""Multi-process (gloo, 3 ranks) tests: detection, the clean resume point, bit-exact resumed run.

One clean run and one faulty run with checkpoints are shared by the module; each test resumes
from its own copy of the checkpoint directory.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from replicheck.campaign.runner import install_for_campaign
from replicheck.checkpoint import CheckpointStore
from replicheck.faults import Fault
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import node_names, run_local
from replicheck.harness.workloads import DecoderConfig

MODEL = DecoderConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)
END = 33  # steps 0..32: the resumed part 21..32 includes the verification at step 30
GUARD = GuardConfig(verify_every=10, weights_every=10)
# Bad hardware on rank 1 from step 23, through the public injector.
FAULT = functools.partial(
    install_for_campaign,
    fault=Fault.at_forward("blocks.0.ffn").persistent(from_step=23).scale(2.0).on_rank(1),
)


def _run(**kw: Any) -> list[JobResult]:
    spec = JobSpec(guard=GUARD, model=MODEL, batch=4, stop_step=END, **kw)
    return run_local(train, node_names(3, 1), args=(spec,), timeout=150)


@dataclass
class Scenario:
    clean: list[JobResult]
    faulty: list[JobResult]
    incident: dict[str, Any]
    ckdir: Path


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """A clean run, and a run with a persistent fault on rank 1 from step 23, checkpointing every 5."""
    ckdir = tmp_path_factory.mktemp("dist") / "ck"
    clean = _run()
    faulty = _run(checkpoint_dir=str(ckdir), checkpoint_every=5, setup=FAULT)
    assert faulty[0].incident is not None
    return Scenario(clean=clean, faulty=faulty, incident=faulty[0].incident, ckdir=ckdir)


def _copy(s: Scenario, tmp_path: Path) -> str:
    target = tmp_path / "ck"
    shutil.copytree(s.ckdir, target)
    return str(target)


@pytest.mark.timeout(200)
def test_incident_at_30_resume_point_is_20(scenario: Scenario) -> None:
    """Fault from 23, checkpoints every 5, verification every 10: the incident is at 30 with last pass
    20, and the resume point (and the recommended checkpoint) is the checkpoint of step 20."""
    inc = scenario.incident
    assert inc["step"] == 30 and inc["last_verified_step"] == 20 and inc["suspect_ranks"] == [1]
    assert scenario.faulty[0].checkpoints == [0, 5, 10, 15, 20, 25]
    store = CheckpointStore(scenario.ckdir)
    point = store.resume_point(json.dumps(inc))
    assert point is not None and point.step == 20
    assert point.manifest.last_verified_step == 20 and point.manifest.replicas_checked
    assert point.manifest.world_size == 3
    assert store.annotate(inc).recommended_checkpoint == {"step": 20, "path": str(point.path)}


@pytest.mark.timeout(200)
def test_resumed_run_matches_clean_run_bit_for_bit(scenario: Scenario, tmp_path: Path) -> None:
    """Restarted from the resume point without the fault, every rank's losses from step 21 on and its
    final weights equal the clean run's bit for bit (3-rank DDP on CPU)."""
    resumed = _run(
        checkpoint_dir=_copy(scenario, tmp_path),
        checkpoint_every=5,
        resume=True,
        resume_incident=json.dumps(scenario.incident),
    )
    clean = scenario.clean
    for r in range(3):
        assert resumed[r].resumed_from == 20 and resumed[r].incident is None
        assert 30 in resumed[r].verified_steps
        assert sorted(resumed[r].losses) == list(range(21, END))
        assert resumed[r].losses == {s: clean[r].losses[s] for s in range(21, END)}
        assert resumed[r].weights_digest == clean[r].weights_digest


@pytest.mark.timeout(200)
def test_fault_persisting_after_resume_points_back_to_the_same_checkpoint(
    scenario: Scenario, tmp_path: Path
) -> None:
    """Resumed on the still-faulty rank, the guard knows the lineage's last pass (20): the new incident
    at 30 again names step 20, never the abandoned timeline's checkpoint 25 or the new run's 25."""
    ckdir = _copy(scenario, tmp_path)
    again = _run(
        checkpoint_dir=ckdir,
        checkpoint_every=5,
        resume=True,
        resume_incident=json.dumps(scenario.incident),
        setup=FAULT,
    )
    inc = again[0].incident
    assert again[0].resumed_from == 20 and inc is not None
    assert inc["step"] == 30 and inc["last_verified_step"] == 20
    assert CheckpointStore(ckdir).resume_point(inc).step == 20
    assert (Path(ckdir) / "superseded" / "step-000000025").is_dir()
