"""Single-process tests of the checkpoint store: format, resume rule, verification, retention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ckpt_kit as kit
import pytest
import torch

from replicheck import fingerprint as fp
from replicheck.checkpoint import (
    CheckpointConfigError,
    CheckpointMismatch,
    CheckpointNotFound,
    CheckpointStore,
    CheckpointWarning,
    CheckpointWriteError,
    Manifest,
    ManifestError,
    NoValidCheckpoint,
    resume_point,
)
from replicheck.guard import CorruptionDetected
from replicheck.incident import write_incident

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def filled(tmp_path: Path) -> tuple[CheckpointStore, torch.nn.Module, torch.optim.Optimizer, dict]:
    """Checkpoints at steps 5..25 (every 5), verification every 10, keep=10."""
    store = CheckpointStore(tmp_path / "ck", keep=10)
    model, opt = kit.make()
    saved = kit.run_schedule(store, model, opt, until=25)
    return store, model, opt, saved


def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    """Loading a checkpoint restores weights and optimizer state bit for bit and returns its step."""
    store = CheckpointStore(tmp_path, keep=3)
    model, opt = kit.make()
    ckpt = store.save(7, model, opt, extra={"note": "x", "t": torch.arange(3)})
    before = kit.state(model)
    opt_before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    kit.train_step(model, opt, 99)
    fresh_model, fresh_opt = kit.make(seed=5)
    assert store.load(ckpt, fresh_model, fresh_opt) == 7
    assert kit.same(kit.state(fresh_model), before)
    after = fresh_opt.state_dict()["state"]
    for i, entry in opt_before.items():
        assert all(torch.equal(entry[k], after[i][k]) for k in entry)
    assert store.loaded is not None and store.loaded.extra["note"] == "x"
    assert torch.equal(store.loaded.extra["t"], torch.arange(3))


def test_manifest_records_step_fingerprint_verification_and_version(tmp_path: Path) -> None:
    """The manifest holds the step, the exact weight fingerprint, the guard's last pass and the format version."""
    store = CheckpointStore(tmp_path)
    model, opt = kit.make()
    guard = kit.FakeGuard(last_verified_step=10)
    ckpt = store.save(12, model, opt, guard=guard)
    data = json.loads((ckpt.path / "manifest.json").read_text())
    want = int(fp.combine(fp.digests(list(model.parameters())))) & 0xFFFF_FFFF_FFFF_FFFF
    assert data["step"] == 12 and int(data["weights_digest"], 16) == want
    assert data["last_verified_step"] == 10 and data["verify_every"] == 10
    assert data["format"] == "replicheck.checkpoint" and data["version"] == 1
    assert Manifest.from_json(json.dumps(data)) == ckpt.manifest
    assert guard.checks == 1


def test_save_runs_replica_check_first_and_writes_nothing_on_mismatch(tmp_path: Path) -> None:
    """When the guard's replica check fails, save raises it and no checkpoint appears."""
    store = CheckpointStore(tmp_path / "ck")
    model, opt = kit.make()
    boom = CorruptionDetected(kit.incident(12, 10))
    with pytest.raises(CorruptionDetected):
        store.save(12, model, opt, guard=kit.FakeGuard(fail=boom))
    assert not (tmp_path / "ck").exists() or store.checkpoints() == []


def test_resume_point_without_incident_is_newest(filled) -> None:
    """Without an incident the resume point is the newest valid checkpoint."""
    store, *_ = filled
    assert store.resume_point().step == 25


def test_resume_point_last_pass_picks_last_verified_step(filled) -> None:
    """Incident at 30 with last pass 20: the newest checkpoint not after 20 (the state after step 20's
    verified update) is chosen, not the newer 25."""
    store, *_ = filled
    assert store.resume_point(kit.incident(30, 20)).step == 20


def test_resume_point_two_passes_goes_one_verification_back(filled) -> None:
    """Policy two_passes bounds the resume point by the pass before the last one (10)."""
    store, *_ = filled
    assert store.resume_point(kit.incident(30, 20), policy="two_passes").step == 10


def test_incident_accepted_as_object_dict_json_and_file(filled, tmp_path: Path) -> None:
    """The incident may be given as the object, its dict, its JSON text, or the file the guard wrote."""
    store, *_ = filled
    inc = kit.incident(30, 20)
    path = write_incident(inc, tmp_path / "inc")
    for form in (inc, inc.to_dict(), inc.to_json(), str(path), path):
        assert store.resume_point(form).step == 20
    assert resume_point(store.directory, inc.to_json()).step == 20


def test_incident_without_last_pass_uses_manifests(filled) -> None:
    """An incident that does not know its last pass falls back to the newest one recorded by checkpoints."""
    store, *_ = filled
    assert store.resume_point(kit.incident(27, None)).step == 20


def test_no_clean_checkpoint_gives_none(filled) -> None:
    """When every checkpoint is after the last pass, there is no resume point (start from scratch)."""
    store, *_ = filled
    assert store.resume_point(kit.incident(10, 0)) is None


def test_annotate_fills_recommended_checkpoint(filled) -> None:
    """annotate() returns the incident with recommended_checkpoint = {step, path} of the resume point."""
    store, *_ = filled
    out = store.annotate(kit.incident(30, 20).to_json())
    assert out.recommended_checkpoint == {"step": 20, "path": str(store.directory / "step-000000020")}
    assert out.id == "job-s30-replay"


def _load_newest(store: CheckpointStore, saved: dict, match: str) -> None:
    model, opt = kit.make(seed=3)
    with pytest.warns(CheckpointWarning, match=match):
        step = store.load(store.checkpoints()[-1], model, opt)
    assert step == 20
    assert kit.same(kit.state(model), saved[20])
    assert store.loaded is not None and len(store.loaded.refused) == 1


def test_flipped_byte_is_refused_and_previous_used(filled) -> None:
    """A payload with one flipped byte fails its checksum; load warns and restores the previous checkpoint."""
    store, _, _, saved = filled
    kit.flip_byte(store.directory / "step-000000025" / "state.pt")
    _load_newest(store, saved, "SHA-256")


def test_truncated_payload_is_refused_and_previous_used(filled) -> None:
    """A truncated payload is refused by its size; load warns and restores the previous checkpoint."""
    store, _, _, saved = filled
    p = store.directory / "step-000000025" / "state.pt"
    p.write_bytes(p.read_bytes()[:1000])
    _load_newest(store, saved, "truncated")


def test_manifest_fingerprint_mismatch_is_refused_and_previous_used(filled) -> None:
    """A manifest whose weight fingerprint disagrees with the payload is refused before any weight is restored."""
    store, _, _, saved = filled
    kit.edit_manifest(store.directory / "step-000000025", weights_digest="0123456789abcdef")
    _load_newest(store, saved, "weight fingerprint")


def test_resume_point_skips_corrupt_checkpoint(filled) -> None:
    """resume_point() never returns a checkpoint whose payload fails its checksum."""
    store, *_ = filled
    kit.flip_byte(store.directory / "step-000000025" / "state.pt", offset=100)
    with pytest.warns(CheckpointWarning):
        assert store.resume_point().step == 20


def test_all_corrupt_raises_no_valid_checkpoint(tmp_path: Path) -> None:
    """When every candidate is refused, load raises NoValidCheckpoint listing each reason, model untouched."""
    store = CheckpointStore(tmp_path, keep=5)
    model, opt = kit.make()
    kit.run_schedule(store, model, opt, until=10)
    for c in store.checkpoints():
        kit.flip_byte(c.path / "state.pt")
    before = kit.state(model)
    with pytest.warns(CheckpointWarning), pytest.raises(NoValidCheckpoint) as err:
        store.load(store.checkpoints()[-1], model, opt)
    assert len(err.value.reasons) == 2 and "step-000000005" in str(err.value)
    assert kit.same(kit.state(model), before)


def test_bad_inputs_raise_typed_errors(tmp_path: Path) -> None:
    """Missing directory, missing checkpoint, malformed manifest and bad arguments raise typed errors."""
    model, opt = kit.make()
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        CheckpointStore(tmp_path / "nope").resume_point()
    store = CheckpointStore(tmp_path / "ck")
    with pytest.raises(CheckpointNotFound, match="no checkpoint"):
        store.load(None, model, opt)
    with pytest.raises(CheckpointConfigError):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(CheckpointConfigError):
        store.save(-1, model, opt)
    with pytest.raises(CheckpointConfigError, match="extra"):
        store.save(1, model, opt, extra={"f": object()})
    with pytest.raises(CheckpointConfigError, match="policy"):
        store.resume_point(policy="newest")
    with pytest.raises(CheckpointConfigError, match="bad incident"):
        store.resume_point("{not json")
    for text in ("[]", "{", json.dumps({"format": "replicheck.checkpoint", "version": 99})):
        with pytest.raises(ManifestError):
            Manifest.from_json(text)


def test_malformed_manifest_is_skipped(tmp_path: Path) -> None:
    """A checkpoint whose manifest is not valid JSON is not offered as a resume point."""
    store = CheckpointStore(tmp_path, keep=5)
    model, opt = kit.make()
    kit.run_schedule(store, model, opt, until=10)
    (tmp_path / "step-000000010" / "manifest.json").write_text("{truncated")
    assert store.resume_point().step == 5
    assert len(store.scan()[1]) == 1


def test_mismatched_model_raises_and_changes_nothing(tmp_path: Path) -> None:
    """A valid checkpoint that does not fit the model raises CheckpointMismatch and leaves the model as it was."""
    store = CheckpointStore(tmp_path)
    model, opt = kit.make()
    ckpt = store.save(3, model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    before = kit.state(other)
    with pytest.raises(CheckpointMismatch):
        store.load(ckpt, other, torch.optim.AdamW(other.parameters()))
    assert kit.same(kit.state(other), before)


def test_write_failure_is_typed(tmp_path: Path) -> None:
    """A checkpoint directory that cannot be created gives CheckpointWriteError, not an OSError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model, opt = kit.make()
    with pytest.raises(CheckpointWriteError, match="step 1"):
        CheckpointStore(blocker / "ck").save(1, model, opt)


def test_retention_keeps_last_k_and_the_resume_points(tmp_path: Path) -> None:
    """keep=2 keeps the two newest checkpoints plus the resume points of both policies."""
    store = CheckpointStore(tmp_path, keep=2)
    model, opt = kit.make()
    kit.run_schedule(store, model, opt, until=29, every=1)
    assert [c.step for c in store.checkpoints()] == [10, 20, 28, 29]
    assert store.resume_point(kit.incident(30, 20)).step == 20


def test_resuming_retires_the_abandoned_timeline(filled) -> None:
    """After loading step 20, the newer (suspect) checkpoint 25 is moved aside, so a later plain
    resume cannot pick it."""
    store, *_ = filled
    model, opt = kit.make(seed=3)
    store.load(store.resume_point(kit.incident(30, 20)), model, opt)
    assert store.resume_point().step == 20
    assert (store.directory / "superseded" / "step-000000025" / "manifest.json").exists()


_CRASH = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {kit_dir!r})
    import ckpt_kit as kit
    from replicheck.checkpoint import CheckpointStore, atomic
    store = CheckpointStore({directory!r}, keep=10)
    model, opt = kit.make()
    kit.run_schedule(store, model, opt, until=10)
    atomic.commit = lambda staged, final: os._exit(17)   # the process dies between write and rename
    kit.train_step(model, opt, 11)
    store.save(15, model, opt, guard=kit.FakeGuard(last_verified_step=10))
""")


def test_crash_between_write_and_rename_leaves_previous_usable(tmp_path: Path) -> None:
    """A writer killed after writing but before the rename leaves only a hidden staging directory:
    the previous checkpoints load, and the next save cleans the leftover."""
    directory = tmp_path / "ck"
    code = _CRASH.format(kit_dir=str(Path(kit.__file__).parent), directory=str(directory))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers and (directory / leftovers[0] / "manifest.json").exists()
    store = CheckpointStore(directory, keep=10)
    assert [c.step for c in store.checkpoints()] == [5, 10]
    model, opt = kit.make(seed=4)
    assert store.load(store.resume_point(), model, opt) == 10
    store.save(15, model, opt)
    assert not any(p.name.startswith(".tmp-") for p in directory.iterdir())
    assert os.path.isdir(directory / "step-000000015")
