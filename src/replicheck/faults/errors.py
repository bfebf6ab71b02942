"""Errors of the fault injector."""

from __future__ import annotations


class FaultError(RuntimeError):
    """Base class of fault-injector errors."""


class FaultConfigError(FaultError, ValueError):
    """A fault was described inconsistently (unknown module, bad bit, empty tensor...)."""
