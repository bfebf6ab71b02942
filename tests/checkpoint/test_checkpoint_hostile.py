"""Checkpoint store edge cases (issue 13 item 11): hostile manifests cost one checkpoint, not the
store; a failure to retire newer checkpoints after a restore does not raise on the writer rank."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from ckpt_kit import make, run_schedule, state

from replicheck.checkpoint import CheckpointStore
from replicheck.checkpoint.store import MANIFEST_NAME

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "manifest",
    [
        "__NUL__",
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 2000 + b"1" + b"}" * 2000,
    ],
)
def test_hostile_manifest_skips_one_checkpoint(tmp_path: Path, manifest: object) -> None:
    """A NUL in a manifest field or a deeply nested manifest makes only that checkpoint unreadable."""
    model, opt = make()
    store = CheckpointStore(tmp_path, keep=10)
    run_schedule(store, model, opt, until=20, every=10)
    newest = store.checkpoints()[-1].path / MANIFEST_NAME
    if manifest == "__NUL__":
        newest.write_text(newest.read_text().replace('"payload": "', '"payload": "\\u0000'))
    else:
        newest.write_bytes(manifest)  # type: ignore[arg-type]
    found, bad = store.scan()
    assert [c.step for c in found] == [10] and len(bad) == 1
    assert store.resume_point() is not None and store.resume_point().step == 10  # type: ignore[union-attr]


def test_step_directory_with_non_ascii_digits_is_ignored(tmp_path: Path) -> None:
    """A directory named with non-ASCII digits (step-٠٠٠...) is not taken for a checkpoint."""
    model, opt = make()
    store = CheckpointStore(tmp_path, keep=10)
    run_schedule(store, model, opt, until=10, every=10)
    (tmp_path / ("step-" + "\u0660" * 8 + "\u0665")).mkdir()
    found, bad = store.scan()
    assert [c.step for c in found] == [10] and bad == []


def test_retire_failure_after_restore_warns_instead_of_raising(tmp_path: Path) -> None:
    """When newer checkpoints cannot be moved aside, load() still returns the restored step (with a warning)."""
    model, opt = make()
    store = CheckpointStore(tmp_path, keep=10)
    saved = run_schedule(store, model, opt, until=20, every=10)
    (tmp_path / "superseded").write_text("a file where the directory should be")
    first = store.checkpoints()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.load(first, model, opt) == 10
    assert any("could not move newer checkpoints" in str(w.message) for w in caught)
    assert state(model).keys() == saved[10].keys()
