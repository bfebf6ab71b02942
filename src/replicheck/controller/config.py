"""Controller configuration: a frozen, validated dataclass, loadable from a TOML file."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from replicheck.controller.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """How the controller acts. Defaults are the safe ones: dry-run, human approval."""

    apply: bool = False
    """Perform destructive actions (cordon, uncordon, replace, resume). False = dry-run."""
    auto_approve: bool = False
    """Replace without a recorded human approval (the operator opted into automatic recovery)."""
    triage: bool = True
    """Run the known-answer self-test on the suspects of ambiguous or transient incidents."""
    triage_persistent: bool = False
    """Also self-test the suspects of persistent incidents, so every approval request shows it."""
    max_replacements: int = 1
    """At most this many node replacements within ``replacement_window_s`` (blast radius)."""
    replacement_window_s: float = 86400.0
    """Length of the sliding window for ``max_replacements`` and ``max_cordons``, in seconds."""
    max_cordons: int = 8
    """At most this many cordons within ``replacement_window_s``, over all incidents (blast
    radius); further incidents wait, saying so."""
    max_cordons_per_incident: int = 4
    """An incident naming more nodes than this cordons none and fails, for a person to judge."""
    max_cordons_per_job: int = 4
    """At most this many cordons within ``replacement_window_s`` for the incidents of one job, so
    one job (or whoever holds its credential) cannot drain the cluster; its further incidents
    wait, saying so. Cordons of a dismissed incident no longer count (here or in ``max_cordons``)."""
    checkpoint_roots: tuple[str, ...] = ()
    """Directories a job may be resumed from: a recommended checkpoint whose path is not under
    one of them (``..`` collapsed; ``{job_id}`` is replaced by the incident's job id, e.g.
    ``"/shared/ckpt/{job_id}"``) is refused and the job is not resumed. Empty: no checkpoint
    path is trusted, so an incident that names one is not resumed by the controller."""
    retry_max_attempts: int = 5
    """Attempts of one action on temporary backend errors before the incident is failed."""
    retry_base_delay_s: float = 2.0
    """First retry delay; doubled on each further attempt."""
    retry_max_delay_s: float = 60.0
    """Upper bound of the retry delay."""
    return_poll_s: float = 5.0
    """How often to check whether a replaced node is back."""
    return_timeout_s: float = 3600.0
    """Resume without a replaced node (keeping it excluded) if it is not back after this long."""
    poll_interval_s: float = 5.0
    """Pause between two reconcile passes of ``controller run``."""
    db_busy_timeout_s: float = 30.0
    """How long one database statement waits for another process's lock before the pass gives
    up (and is retried after a back-off)."""
    error_backoff_max_s: float = 60.0
    """Longest pause after a pass failed for a reason outside the controller (database locked,
    disk full, out of file descriptors): the pause starts at ``poll_interval_s`` and doubles."""
    liveness_window_s: float = 60.0
    """``/healthz`` fails when the acting loop's last completed pass is older than this (or than
    three poll intervals, whichever is longer)."""
    incident_dirs: tuple[str, ...] = ()
    """Directories watched for incident files (the jobs' ``incident_dir``)."""
    drain_reason: str = "replicheck: suspected silent data corruption"
    """Reason recorded when cordoning; uncordon only touches nodes drained with this prefix."""
    actor: str = "controller"
    """Name recorded in the audit log for the controller's own actions."""

    def __post_init__(self) -> None:
        for name in ("max_replacements", "max_cordons", "max_cordons_per_incident", "max_cordons_per_job"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.retry_max_attempts < 1:
            raise ConfigError("retry_max_attempts must be >= 1")
        for name in (
            "replacement_window_s",
            "retry_base_delay_s",
            "retry_max_delay_s",
            "return_poll_s",
            "return_timeout_s",
            "poll_interval_s",
            "db_busy_timeout_s",
            "error_backoff_max_s",
            "liveness_window_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not self.drain_reason.strip():
            raise ConfigError("drain_reason must not be empty")
        if not self.drain_reason.isprintable():
            raise ConfigError("drain_reason must be printable text (no newline or control character)")
        if not isinstance(self.incident_dirs, tuple):
            raise ConfigError("incident_dirs must be a tuple of paths")
        if not isinstance(self.checkpoint_roots, tuple):
            raise ConfigError("checkpoint_roots must be a tuple of paths")
        for root in self.checkpoint_roots:
            if not isinstance(root, str) or not root.startswith("/") or not root.isprintable():
                raise ConfigError(f"checkpoint_roots must be absolute paths, got {root!r}")

    def with_overrides(self, **changes: Any) -> ControllerConfig:
        """A copy with the non-None ``changes`` applied (used for command-line flags)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def config_from_mapping(data: Mapping[str, Any], cls: type[Any] = ControllerConfig) -> Any:
    """Build ``cls`` from a mapping, rejecting unknown keys and wrong types with ConfigError."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        default = getattr(cls(), key) if key in known else None
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{key} must be a list of strings")
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{key} must be a number, got {value!r}")
        elif isinstance(default, str) or default is None:
            if value is not None and not isinstance(value, (str, list)):
                raise ConfigError(f"{key} has the wrong type: {value!r}")
            if isinstance(value, list):
                value = tuple(str(v) for v in value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file: ``[controller]`` and optional ``[slurm]``, ``[kubernetes]``,
    ``[hyperpod]`` tables."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
    unknown = sorted(set(data) - {"controller", "slurm", "local", "kubernetes", "hyperpod"})
    if unknown:
        raise ConfigError(f"{p}: unknown section(s): {', '.join(unknown)}")
    for key, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{p}: [{key}] must be a table")
    return data
