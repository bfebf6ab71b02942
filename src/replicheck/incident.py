"""The incident record: the only contract between the training job and the controller.

Standard library only, so the controller can read incidents without torch. A record is
versioned JSON; :func:`Incident.from_json` rejects malformed or unknown-version input with
:class:`IncidentFormatError` and never guesses.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from replicheck.timefmt import utc_iso

SCHEMA = "replicheck.incident"
SCHEMA_VERSION = 1

Check = Literal["replay", "gradients", "reduced_gradients", "weights", "optimizer_state"]
Classification = Literal["persistent", "transient", "ambiguous"]

CHECKS: tuple[str, ...] = ("replay", "gradients", "reduced_gradients", "weights", "optimizer_state")
CLASSIFICATIONS: tuple[str, ...] = ("persistent", "transient", "ambiguous")


class IncidentFormatError(ValueError):
    """A record is not a valid incident of a version this code understands."""


@dataclass(frozen=True)
class NodeIdentity:
    """Where a rank runs, in every naming scheme known at the time of the incident."""

    name: str
    """The node name replicheck uses (explicit, or REPLICHECK_NODE / SLURMD_NODENAME / host name)."""
    hostname: str | None = None
    """The operating system's host name."""
    slurm_node: str | None = None
    """The Slurm node name (SLURMD_NODENAME) when running under Slurm."""
    k8s_node: str | None = None
    """The Kubernetes node name when running in a pod that exposes it."""
    instance_id: str | None = None
    """The cloud instance id (for example ``i-0123...``) when known."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeIdentity:
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise IncidentFormatError("node identity needs a non-empty 'name'")
        kwargs: dict[str, str | None] = {}
        for key in ("hostname", "slurm_node", "k8s_node", "instance_id"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise IncidentFormatError(f"node identity field {key!r} must be a string or null")
            kwargs[key] = value
        return cls(name=name, **kwargs)


@dataclass(frozen=True)
class Suspect:
    """A rank named by a check, with the node it ran on."""

    rank: int
    """Global rank of the suspect process."""
    node: NodeIdentity
    """Where that rank ran."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Suspect:
        rank = data.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise IncidentFormatError("suspect 'rank' must be a non-negative integer")
        node = data.get("node")
        if not isinstance(node, Mapping):
            raise IncidentFormatError("suspect 'node' must be an object")
        return cls(rank=rank, node=NodeIdentity.from_dict(node))


@dataclass(frozen=True)
class Incident:
    """One detection, as the job saw it. Every rank holds an identical copy."""

    id: str
    """Stable identifier: the same detection reported by several ranks has the same id."""
    job_id: str
    """The training job (Slurm job id, or the id given to the guard)."""
    step: int
    """The step whose update was stopped."""
    check: Check
    """The check that fired first: replay, gradients, reduced_gradients, weights, optimizer_state."""
    suspect_ranks: tuple[int, ...]
    """Global ranks named; empty when the verdict is ambiguous."""
    suspect_nodes: tuple[str, ...]
    """Node names of the suspect ranks (or of the candidates when ambiguous)."""
    classification: Classification
    """persistent (same wrong answer on re-run), transient (re-run differs), or ambiguous."""
    suspects: tuple[Suspect, ...] = ()
    """Suspect ranks with full node identity (hostname, Slurm / Kubernetes name, instance id)."""
    candidates: tuple[Suspect, ...] = ()
    """When ambiguous: the ranks that could not be told apart."""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    """Check-specific evidence: fingerprints, losses, pair outcomes, votes (JSON values)."""
    last_verified_step: int | None = None
    """The newest step whose replay verification passed before this incident."""
    recommended_checkpoint: Mapping[str, Any] | None = None
    """The checkpoint to resume from (``{"step": int, "path": str}``) when known."""
    world_size: int = 1
    """Number of ranks in the job."""
    checks_failed: tuple[str, ...] = ()
    """Every check that failed on this step (``check`` is the first of these)."""
    time: str = field(default_factory=utc_iso)
    """When the incident was raised, ISO 8601 with UTC offset."""
    version: int = SCHEMA_VERSION
    """Schema version of this record."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        for key in ("suspect_ranks", "suspect_nodes", "suspects", "candidates", "checks_failed"):
            data[key] = list(data[key])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Incident:
        if not isinstance(data, Mapping):
            raise IncidentFormatError("an incident must be a JSON object")
        if data.get("schema") != SCHEMA:
            raise IncidentFormatError(f"not a replicheck incident (schema={data.get('schema')!r})")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise IncidentFormatError(
                f"unsupported incident version {version!r}; this build reads version {SCHEMA_VERSION}"
            )
        return cls(
            id=_req_str(data, "id"),
            job_id=_req_str(data, "job_id"),
            step=_req_int(data, "step"),
            check=_req_choice(data, "check", CHECKS),  # type: ignore[arg-type]
            suspect_ranks=tuple(_int_list(data, "suspect_ranks")),
            suspect_nodes=tuple(_str_list(data, "suspect_nodes")),
            classification=_req_choice(data, "classification", CLASSIFICATIONS),  # type: ignore[arg-type]
            suspects=tuple(Suspect.from_dict(s) for s in _obj_list(data, "suspects")),
            candidates=tuple(Suspect.from_dict(s) for s in _obj_list(data, "candidates")),
            evidence=_req_mapping(data, "evidence", default={}),
            last_verified_step=_opt_int(data, "last_verified_step"),
            recommended_checkpoint=_opt_mapping(data, "recommended_checkpoint"),
            world_size=_req_int(data, "world_size"),
            checks_failed=tuple(_str_list(data, "checks_failed")),
            time=_req_time(data),
            version=SCHEMA_VERSION,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Incident:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise IncidentFormatError(f"incident is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats become strings, tuples lists, keys strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def make_incident_id(job_id: str, step: int, check: str) -> str:
    """The id every rank computes for the same detection, so duplicates merge."""
    return f"{job_id}-s{step}-{check}"


def write_incident(incident: Incident, directory: str | os.PathLike[str]) -> Path:
    """Write ``incident`` to ``directory`` atomically (temp file, fsync, rename); return its path."""
    target_dir = Path(directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / f"{_safe_name(incident.id)}.json"
    fd, tmp = tempfile.mkstemp(prefix=".incident-", suffix=".tmp", dir=target_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(incident.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def read_incident(path: str | os.PathLike[str]) -> Incident:
    """Read and validate one incident file; raise IncidentFormatError with the path on bad input."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise IncidentFormatError(f"{p}: cannot read incident: {exc}") from exc
    try:
        return Incident.from_json(text)
    except IncidentFormatError as exc:
        raise IncidentFormatError(f"{p}: {exc}") from exc


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _req_str(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise IncidentFormatError(f"field {key!r} must be a non-empty string")
    return value


def _req_int(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IncidentFormatError(f"field {key!r} must be a non-negative integer")
    return value


def _opt_int(data: Mapping[str, Any], key: str) -> int | None:
    return None if data.get(key) is None else _req_int(data, key)


def _req_choice(data: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = data.get(key)
    if value not in choices:
        raise IncidentFormatError(f"field {key!r} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _req_mapping(data: Mapping[str, Any], key: str, default: dict[str, Any]) -> Mapping[str, Any]:
    value = data.get(key, default)
    if not isinstance(value, Mapping):
        raise IncidentFormatError(f"field {key!r} must be an object")
    return value


def _opt_mapping(data: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = data.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise IncidentFormatError(f"field {key!r} must be an object or null")
    return value


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise IncidentFormatError(f"field {key!r} must be a list")
    return value


def _int_list(data: Mapping[str, Any], key: str) -> list[int]:
    items = _list(data, key)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise IncidentFormatError(f"field {key!r} must be a list of non-negative integers")
    return items


def _str_list(data: Mapping[str, Any], key: str) -> list[str]:
    items = _list(data, key)
    if not all(isinstance(i, str) and i for i in items):
        raise IncidentFormatError(f"field {key!r} must be a list of non-empty strings")
    return items


def _obj_list(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = _list(data, key)
    if not all(isinstance(i, Mapping) for i in items):
        raise IncidentFormatError(f"field {key!r} must be a list of objects")
    return items


def _req_time(data: Mapping[str, Any]) -> str:
    value = _req_str(data, "time")
    try:
        parsed = _dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise IncidentFormatError(f"field 'time' is not ISO 8601: {value!r}") from exc
    if parsed.utcoffset() is None:
        raise IncidentFormatError(f"field 'time' needs a UTC offset: {value!r}")
    return value
