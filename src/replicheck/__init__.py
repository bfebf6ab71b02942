"""replicheck: find silent data corruption in distributed PyTorch training.

The training-side names (``Guard`` and friends) import torch, so they are loaded lazily:
``import replicheck.controller`` or ``replicheck.incident`` never pulls in torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from replicheck.codes import EXIT_CORRUPTION

__version__ = "0.1.0"

# A library prints nothing unless the application configures logging (the CLI does, -v/--quiet).
logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from replicheck.guard import (
        CorruptionDetected,
        Guard,
        GuardConfig,
        StepResult,
        is_replaying,
    )

_LAZY = {
    "Guard": "replicheck.guard",
    "GuardConfig": "replicheck.guard",
    "CorruptionDetected": "replicheck.guard",
    "StepResult": "replicheck.guard",
    "is_replaying": "replicheck.guard",
}

__all__ = [
    "EXIT_CORRUPTION",
    "CorruptionDetected",
    "Guard",
    "GuardConfig",
    "StepResult",
    "__version__",
    "is_replaying",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'replicheck' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
