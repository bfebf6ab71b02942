"""The record of one committed checkpoint, in a module of its own so that the store (which lists
checkpoints) and the restore path (which reads them) both use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.checkpoint.manifest import Manifest


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint on disk."""

    step: int
    """The step whose update it holds (the state after step ``step``)."""
    path: Path
    """Its directory (``<store>/step-000000020``)."""
    manifest: Manifest
    """Its manifest as read when it was listed."""

    @property
    def last_verified_step(self) -> int | None:
        """The guard's newest passing verification when it was saved."""
        return self.manifest.last_verified_step

    def ref(self) -> dict[str, Any]:
        """``{"step": int, "path": str}``, the incident's ``recommended_checkpoint`` value."""
        return {"step": self.step, "path": str(self.path)}
