"""The training-side core: :class:`Guard` and its configuration, errors and context.

Layout (``docs/architecture.md``): ``step/`` the step and its verdict; ``parallel/`` one object
per kind of parallel job behind one seam; ``checks/`` the checks; ``attribution/`` who is to
blame; ``transport/`` what crosses ranks. Importing this package registers the built-in
parallelisms.
"""

from replicheck.guard.attribution.ring import Ring
from replicheck.guard.config import GuardConfig
from replicheck.guard.context import current_pass, current_step, is_replaying
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
from replicheck.guard.parallel import Parallelism
from replicheck.guard.step.guard import Guard, StepResult

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
    "Parallelism",
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
