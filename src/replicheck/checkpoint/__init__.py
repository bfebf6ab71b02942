"""Verified checkpoints and the clean resume point after an incident.

``CheckpointStore(directory, keep=5)``: :meth:`~CheckpointStore.save` (collective; the guard's
replica check first, rank 0 writes atomically with a manifest), :meth:`~CheckpointStore.resume_point`
(the newest checkpoint not after the last passing verification before an incident),
:meth:`~CheckpointStore.load` (verifies, falls back to the next older valid checkpoint),
:meth:`~CheckpointStore.annotate` (fills an incident's ``recommended_checkpoint``).
The manifest format is documented in ``docs/checkpoints.md``.
"""

from replicheck.checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointNotFound,
    CheckpointWarning,
    CheckpointWriteError,
    ManifestError,
    NoValidCheckpoint,
)
from replicheck.checkpoint.manifest import FORMAT, FORMAT_VERSION, Manifest
from replicheck.checkpoint.policy import POLICIES, Policy, clean_bound
from replicheck.checkpoint.record import Checkpoint
from replicheck.checkpoint.store import (
    CheckpointStore,
    Loaded,
    resume_point,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "POLICIES",
    "Checkpoint",
    "CheckpointConfigError",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CheckpointStore",
    "CheckpointWarning",
    "CheckpointWriteError",
    "Loaded",
    "Manifest",
    "ManifestError",
    "NoValidCheckpoint",
    "Policy",
    "clean_bound",
    "resume_point",
]
