"""The replicheck controller: turns incidents into the recovery procedure (cordon, triage,
approval, replacement, resume) on a cluster backend. Never imports torch."""

from replicheck.controller.backends import (
    Backend,
    LocalBackend,
    NodeInfo,
    ResumeRecord,
    ResumeRequest,
)
from replicheck.controller.config import ControllerConfig
from replicheck.controller.controller import Controller, IncidentView, IngestResult
from replicheck.controller.errors import (
    BackendError,
    ConfigError,
    ControllerError,
    InvalidTransitionError,
    PermanentBackendError,
    QuarantinedError,
    StoreError,
    TransientBackendError,
    UnknownIncidentError,
)
from replicheck.controller.model import (
    Action,
    ActionKind,
    Record,
    State,
    Transition,
    TriageResult,
)

__all__ = [
    "Action",
    "ActionKind",
    "Backend",
    "BackendError",
    "ConfigError",
    "Controller",
    "ControllerConfig",
    "ControllerError",
    "IncidentView",
    "IngestResult",
    "InvalidTransitionError",
    "LocalBackend",
    "NodeInfo",
    "PermanentBackendError",
    "QuarantinedError",
    "Record",
    "ResumeRecord",
    "ResumeRequest",
    "State",
    "StoreError",
    "Transition",
    "TransientBackendError",
    "TriageResult",
    "UnknownIncidentError",
]
