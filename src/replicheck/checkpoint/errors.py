"""Typed errors of the checkpoint store: every bad input ends in one of these, with a message
that names the checkpoint and the reason, never in a bare traceback from ``torch.load``."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by :mod:`replicheck.checkpoint`."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An argument of the store is invalid (``keep < 1``, an unknown policy, a negative step)."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """The directory, or the checkpoint asked for, does not exist."""


class ManifestError(CheckpointError):
    """A manifest is missing, not JSON, of an unknown format version, or has a bad field."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint failed verification: checksum, size, fingerprint, or payload structure."""


class CheckpointMismatch(CheckpointError):
    """A valid checkpoint does not fit the model or optimizer it is loaded into."""


class NoValidCheckpoint(CheckpointError):
    """Every candidate checkpoint was refused; ``reasons`` says why each one was."""

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        self.reasons = list(reasons or [])
        detail = "".join(f"\n  - {r}" for r in self.reasons)
        super().__init__(message + detail)


class CheckpointWriteError(CheckpointError):
    """The writing rank could not write the checkpoint; raised on every rank alike."""


class CheckpointWarning(UserWarning):
    """A checkpoint was refused and an older one is used instead."""
