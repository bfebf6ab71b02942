"""The training-side core: :class:`Guard` and its configuration, errors and context."""

from replicheck.guard.config import GuardConfig
from replicheck.guard.context import current_pass, current_step, is_replaying
from replicheck.guard.core import Guard, StepResult
from replicheck.guard.errors import (
    BatchError,
    CorruptionDetected,
    DeterminismError,
    GuardConfigError,
    GuardError,
    GuardMisuseError,
    LossContractError,
    PeerFailed,
    UpdateReplayError,
)
from replicheck.guard.loss import LossReduction, LossSum
from replicheck.guard.ring import Ring

__all__ = [
    "BatchError",
    "CorruptionDetected",
    "DeterminismError",
    "Guard",
    "GuardConfig",
    "GuardConfigError",
    "GuardError",
    "GuardMisuseError",
    "LossContractError",
    "PeerFailed",
    "LossReduction",
    "LossSum",
    "Ring",
    "StepResult",
    "UpdateReplayError",
    "current_pass",
    "current_step",
    "is_replaying",
]
