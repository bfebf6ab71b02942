"""Sharded checkpoints (FSDP2, HSDP) through torch.distributed.checkpoint: the resume point after
an incident, a bit-identical resumed run, and shard files damaged on disk refused."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from replicheck.campaign.runner import install_for_campaign
from replicheck.checkpoint import CheckpointStore
from replicheck.checkpoint.sharded import DCP_DIR
from replicheck.faults import Fault
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import node_names, run_local
from replicheck.harness.workloads import DecoderConfig

MODEL = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
GUARD = GuardConfig(verify_every=5, weights_every=5)
FAULT = functools.partial(
    install_for_campaign,
    fault=Fault.at_forward("blocks.0.ffn").persistent(from_step=12).scale(2.0).on_rank(1),
)


def _run(parallel: str, ranks: int, **kw: Any) -> list[JobResult]:
    spec = JobSpec(guard=GUARD, model=MODEL, batch=4, stop_step=18, parallel=parallel, keep_state=True, **kw)
    return run_local(train, node_names(ranks, 1), args=(spec,), timeout=150)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 3), ("hsdp", 4)])
def test_sharded_resume_after_an_incident_is_bit_identical(parallel: str, ranks: int, tmp_path: Path) -> None:
    """A fault from step 12 is caught at 15 (last pass 10); the resume point is the checkpoint of
    step 10; the job resumed from it without the fault ends with weights bit-identical to a clean
    uninterrupted run."""
    ckdir = tmp_path / "ck"
    faulty = _run(parallel, ranks, checkpoint_dir=str(ckdir), checkpoint_every=5, setup=FAULT)
    inc = faulty[0].incident
    assert inc is not None and (inc["step"], inc["last_verified_step"]) == (15, 10)
    store = CheckpointStore(ckdir)
    point = store.resume_point(json.dumps(inc))
    assert point is not None and point.step == 10
    assert point.manifest.sharded and point.manifest.world_size == ranks
    assert point.manifest.payload == DCP_DIR
    resumed = _run(parallel, ranks, checkpoint_dir=str(ckdir), resume=True, resume_incident=json.dumps(inc))
    clean = _run(parallel, ranks)
    assert resumed[0].resumed_from == 10 and resumed[0].incident is None
    for name, value in clean[0].state.items():  # type: ignore[union-attr]
        assert torch.equal(resumed[0].state[name], value), name  # type: ignore[index]


@pytest.mark.timeout(300)
def test_damaged_shard_file_is_refused_and_the_older_checkpoint_used(tmp_path: Path) -> None:
    """One byte changed in a shard file of the newest checkpoint: every rank refuses it (the tree
    SHA-256 differs) and resumes from the next older one, which restores and verifies."""
    ckdir = tmp_path / "ck"
    _run("fsdp", 3, checkpoint_dir=str(ckdir), checkpoint_every=5)
    newest = ckdir / "step-000000015" / DCP_DIR
    shard = sorted(p for p in newest.iterdir() if p.suffix == ".distcp")[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = _run("fsdp", 3, checkpoint_dir=str(ckdir), resume=True)
    assert resumed[0].resumed_from == 10
    assert resumed[0].last_step == 17


def _mismatch(ctx: Any, ckdir: str) -> str:
    from replicheck.checkpoint.errors import CheckpointMismatch
    from replicheck.harness.jobs import build

    model, opt = build(JobSpec(model=MODEL, parallel="ddp"), ctx)
    store = CheckpointStore(ckdir)
    try:
        store.load(store.resume_point(), model, opt)
    except CheckpointMismatch as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(300)
def test_sharded_checkpoint_into_a_ddp_model_is_a_clear_mismatch(tmp_path: Path) -> None:
    """Loading a sharded checkpoint into an unsharded (DDP) model raises CheckpointMismatch saying
    so, on every rank, and changes nothing on disk."""
    ckdir = tmp_path / "ck"
    _run("fsdp", 2, checkpoint_dir=str(ckdir), checkpoint_every=5)
    before = sorted(p.name for p in ckdir.iterdir())
    for message in run_local(_mismatch, node_names(2, 1), args=(str(ckdir),), timeout=60):
        assert "sharded" in message and "does not load" in message
    assert sorted(p.name for p in ckdir.iterdir()) == before


def _one_rank_refuses(ctx: Any, ckdir: str) -> int:
    from replicheck.checkpoint import sharded
    from replicheck.checkpoint.errors import CheckpointCorrupt
    from replicheck.harness.jobs import build

    model, opt = build(JobSpec(model=MODEL, parallel="fsdp"), ctx)
    if ctx.rank == 1:
        real = sharded.verify

        def flaky(path: Path, manifest: Any) -> None:
            if manifest.step == 15:
                raise CheckpointCorrupt("this rank read different bytes")
            real(path, manifest)

        sharded.verify = flaky  # type: ignore[assignment]
    store = CheckpointStore(ckdir)
    with pytest.warns(Warning):
        return store.load(store.checkpoints()[-1], model, opt, retire_newer=False)


@pytest.mark.timeout(300)
def test_a_candidate_one_rank_refuses_is_refused_on_every_rank(tmp_path: Path) -> None:
    """When only rank 1 finds the newest sharded checkpoint bad, every rank refuses it and restores
    the next older one together (the restore is collective: no rank is left waiting)."""
    ckdir = tmp_path / "ck"
    _run("fsdp", 3, checkpoint_dir=str(ckdir), checkpoint_every=5)
    assert run_local(_one_rank_refuses, node_names(3, 1), args=(str(ckdir),), timeout=120) == [10, 10, 10]
