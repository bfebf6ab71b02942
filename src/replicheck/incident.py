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
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

from replicheck.timefmt import utc_iso

SCHEMA = "replicheck.incident"
SCHEMA_VERSION = 3
"""Newest version this build writes. 2 added the classifications ``data`` and ``divergence``: a
reader of version 1 would reject them as malformed, so they come with a version that such a
reader names as unsupported (upgrade the controller first). 3 added ``continuation`` (the job
went on without the suspect's replica group): a version-2 reader would ignore the field and
resume the whole job, so a record holding it is written as version 3, which such a reader
refuses. A record without it is still written as version 2 (:func:`written_version`), so older
controllers keep reading it. Versions 1 and 2 are still read."""
READABLE_VERSIONS: tuple[int, ...] = (1, 2, 3)
"""Versions this build reads."""

Check = Literal["replay", "gradients", "reduced_gradients", "weights", "optimizer_state", "optimizer_update"]
Classification = Literal["persistent", "transient", "ambiguous", "data", "divergence"]
ContinuationMode = Literal["no_restart"]
JsonValue: TypeAlias = str | int | float | bool | None | Sequence["JsonValue"] | Mapping[str, "JsonValue"]
"""A value as JSON holds it (evidence of an incident is a mapping of these)."""

CHECKS: tuple[Check, ...] = (
    "replay",
    "gradients",
    "reduced_gradients",
    "weights",
    "optimizer_state",
    "optimizer_update",
)
CLASSIFICATIONS: tuple[Classification, ...] = ("persistent", "transient", "ambiguous", "data", "divergence")
"""``persistent``: the suspect gives the same wrong answer when it re-runs its work (hardware).
``transient``: its re-run differs (a one-off fault; triage). ``ambiguous``: the evidence could not
tell the candidates apart. ``data``: another rank on another device reproduced the bad result, so
the data or the model produces it (no node is blamed). ``divergence``: most ranks went bad at
once, so the model diverged (no node is blamed)."""
HARDWARE_CLASSIFICATIONS: frozenset[Classification] = frozenset({"persistent", "transient", "ambiguous"})
"""Classifications that may name a node to act on; ``data`` and ``divergence`` never do."""

# The input grammar the controller enforces at ingest (docs/controller.md). Plain ASCII only, so
# a value can reach a scheduler's argv or a terminal without quoting or escaping.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A node name: one plain host name, never a hostlist expression, option or ``key=value``."""
JOB_ID = re.compile(
    r"(?=[^/]{1,128}(?:/[^/]{1,128})?\Z)[A-Za-z0-9][A-Za-z0-9._+-]*(?:/[A-Za-z0-9][A-Za-z0-9._+-]*)?"
)
"""A job id (a Slurm id such as ``123``, ``123_4``, ``123+0``, a name given to the guard, or a
Kubernetes ``namespace/name``: at most one ``/``, each side starting with a letter or digit)."""
INCIDENT_ID_MAX = 320
"""Longest incident id, in characters."""
INCIDENT_ID = re.compile(r"(?=.{1,320}\Z)[A-Za-z0-9][A-Za-z0-9._:+-]*(?:/[A-Za-z0-9][A-Za-z0-9._:+-]*)?")
"""An incident id (``<job>-s<step>-<check>``; one ``/`` where the job id has one)."""
CHECKPOINT_PATH = re.compile(r"[^\x00-\x1f\x7f-\x9f-][^\x00-\x1f\x7f-\x9f]{0,4095}")
"""A checkpoint path: printable, no control character, not option-like (no leading ``-``)."""
REPLICA_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A replica group id in ``continuation`` (it reaches a launcher's argv: a plain name, no option)."""
CONTINUATION_MODES: tuple[ContinuationMode, ...] = ("no_restart",)
"""How a job may go on after an incident; ``no_restart``: the suspect's replica group left and
the others took the next step without a restart (torchft replica groups, docs/no-restart.md)."""
MAX_EVIDENCE_DEPTH = 32
"""Deepest nesting of lists and objects accepted anywhere in an incident."""
MAX_STEP = 2**62
"""Largest step, rank or world size accepted (SQLite integers are 64-bit)."""
MAX_TIME_SKEW = _dt.timedelta(days=366)
"""An incident's time may be at most this far in the future of the reader's clock."""


MAX_INT = 2**63 - 1
"""Largest magnitude of any integer anywhere in an incident (SQLite and most readers: 64 bits)."""
NON_FINITE = ("NaN", "Infinity", "-Infinity")
"""The one policy for non-finite numbers, on every path in (a file, an HTTP body,
``Controller.ingest``): they are kept as these strings, so a diverged loss is not lost and every
JSON the controller stores and prints is strict."""


class IncidentFormatError(ValueError):
    """A record is not a valid incident of a version this code understands."""


class IncidentJSONError(IncidentFormatError):
    """The input is not JSON at all (syntax, encoding, nesting too deep to parse)."""


class IncidentNotYetValidError(IncidentFormatError):
    """The incident's ``time`` is too far ahead of the reader's clock: it may become valid once
    either clock is right, so a file is read again rather than given up."""


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
class Continuation:
    """How the job went on after the incident, when it did not stop (incident version 3)."""

    mode: ContinuationMode
    """``no_restart``: the suspect's replica group left; the other groups carry on without a
    restart, and recovery starts one replacement group that joins live (never a resume)."""
    replica_group: str
    """The replica group that left (its id as the job's launcher names it, for example torchft's
    replica id): the one the replacement group takes the place of."""

    @classmethod
    def from_dict(cls, data: Any) -> Continuation:
        if not isinstance(data, Mapping):
            raise IncidentFormatError(
                "field 'continuation' must be an object "
                '({"mode": "no_restart", "replica_group": ID}) or absent'
            )
        unknown = sorted(str(k) for k in data if k not in ("mode", "replica_group"))
        if unknown:
            raise IncidentFormatError(f"field 'continuation' has unknown key(s): {', '.join(unknown)}")
        mode = data.get("mode")
        for choice in CONTINUATION_MODES:
            if mode == choice:
                group = data.get("replica_group")
                if not isinstance(group, str) or not group:
                    raise IncidentFormatError("continuation 'replica_group' must be a non-empty string")
                return cls(mode=choice, replica_group=group)
        raise IncidentFormatError(
            f"continuation 'mode' must be one of {', '.join(CONTINUATION_MODES)}; got {_short(mode)}"
        )


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
    """The check that fired first: replay, gradients, reduced_gradients, weights, optimizer_state,
    optimizer_update (plain FSDP2: a rank's update of its shard, replayed by another rank)."""
    suspect_ranks: tuple[int, ...]
    """Global ranks named; empty when the verdict is ambiguous."""
    suspect_nodes: tuple[str, ...]
    """Node names of the suspect ranks (or of the candidates when ambiguous)."""
    classification: Classification
    """persistent (same wrong answer on re-run), transient (re-run differs), ambiguous, data
    (reproduced on another device: not hardware) or divergence (most ranks at once)."""
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
    """Schema version this build reads it as (a record is written as :func:`written_version`)."""
    continuation: Continuation | None = None
    """Set when the job did not stop: it went on without the suspect's replica group
    (``no_restart``), so recovery starts a replacement group instead of resuming the job. None
    (absent from the JSON): the job stopped, as before version 3."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        data["version"] = written_version(self)
        if self.continuation is None:
            del data["continuation"]  # absent, so a version-2 reader sees today's record
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
            raise IncidentFormatError(f"not a replicheck incident (schema={_short(data.get('schema'))})")
        version = data.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise IncidentFormatError(
                f"unsupported incident version {_short(version)}; this build reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        classification = _req_classification(data)
        if version == 1 and classification not in HARDWARE_CLASSIFICATIONS:
            raise IncidentFormatError(f"classification {classification!r} needs incident version 2")
        continuation = None
        if data.get("continuation") is not None:
            if version < 3:
                raise IncidentFormatError(
                    f"field 'continuation' needs incident version 3 (this record says {version}): "
                    "a version-2 reader would ignore it and resume the whole job"
                )
            continuation = Continuation.from_dict(data["continuation"])
        return cls(
            id=_req_str(data, "id"),
            job_id=_req_str(data, "job_id"),
            step=_req_int(data, "step"),
            check=_req_check(data),
            suspect_ranks=tuple(_int_list(data, "suspect_ranks")),
            suspect_nodes=tuple(_str_list(data, "suspect_nodes")),
            classification=classification,
            suspects=tuple(Suspect.from_dict(s) for s in _obj_list(data, "suspects")),
            candidates=tuple(Suspect.from_dict(s) for s in _obj_list(data, "candidates")),
            evidence=_req_mapping(data, "evidence", default={}),
            last_verified_step=_opt_int(data, "last_verified_step"),
            recommended_checkpoint=_opt_mapping(data, "recommended_checkpoint"),
            world_size=_req_int(data, "world_size"),
            checks_failed=tuple(_str_list(data, "checks_failed")),
            time=_req_time(data),
            version=SCHEMA_VERSION,
            continuation=continuation,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Incident:
        """Parse and validate one incident, raising only IncidentFormatError for bad input.

        NaN and Infinity (non-standard JSON a writer may emit for a diverged loss) are kept
        as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every output stays strict JSON.
        """
        incident = cls.from_dict(load_json(text))
        validate_incident(incident)
        return incident


def written_version(incident: Incident) -> int:
    """The version an incident is written as: the oldest that holds its content (3 with a
    ``continuation``, else 2), so a reader that cannot act on it right refuses it, and one
    that can keeps reading it."""
    return 3 if incident.continuation is not None else 2


def load_json(text: str | bytes) -> Any:
    """The one JSON reader for incidents, from files and HTTP bodies alike: non-finite numbers
    become the strings of :data:`NON_FINITE`, duplicate keys are refused, and the result is
    checked for nesting depth, 64-bit integers and storable strings.

    Raises IncidentJSONError when the input is not JSON, IncidentFormatError when it is JSON
    that no incident may hold."""
    try:
        data = json.loads(text, parse_constant=str, object_pairs_hook=_unique_keys)
    except IncidentFormatError:
        raise
    except RecursionError as exc:
        raise IncidentJSONError("incident is nested too deeply to parse") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise IncidentJSONError(f"incident is not valid JSON: {exc}") from exc
    _check_plain(data)
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise IncidentFormatError(
                    f"duplicate key {_short(key)} in a JSON object (which copy counts is ambiguous)"
                )
            seen.add(key)
    return data


def validate_incident(incident: Incident, *, now: _dt.datetime | None = None) -> None:
    """Check ``incident`` against the ingest grammar (module constants above); raise
    IncidentFormatError naming the first violation. What the controller acts on passed this.

    Every path in runs it (files, HTTP bodies, ``Controller.ingest``), so evidence and the
    checkpoint are checked here too: nesting, 64-bit integers, storable strings."""
    _match(INCIDENT_ID, incident.id, "id")
    if not isinstance(incident.evidence, Mapping):
        raise IncidentFormatError("field 'evidence' must be an object")
    _check_plain(incident.evidence, 1)
    if incident.recommended_checkpoint is not None:
        _check_plain(incident.recommended_checkpoint, 1)
    if incident.continuation is not None:
        cont = incident.continuation
        if not isinstance(cont, Continuation) or cont.mode not in CONTINUATION_MODES:
            raise IncidentFormatError("field 'continuation' must be a Continuation with a known mode")
        _match(REPLICA_GROUP, cont.replica_group, "continuation replica_group")
    _match(JOB_ID, incident.job_id, "job_id")
    for number, name in (
        (incident.step, "step"),
        (incident.world_size, "world_size"),
        (incident.last_verified_step, "last_verified_step"),
    ):
        if number is not None and not 0 <= number <= MAX_STEP:
            raise IncidentFormatError(f"field {name!r} is out of range")
    if incident.world_size < 1:
        raise IncidentFormatError("field 'world_size' must be at least 1")
    for rank in incident.suspect_ranks + tuple(s.rank for s in incident.suspects + incident.candidates):
        if rank >= incident.world_size:
            raise IncidentFormatError(f"rank {rank} is not below world_size {incident.world_size}")
    names = list(incident.suspect_nodes)
    for s in incident.suspects + incident.candidates:
        names.append(s.node.name)
        for alias in (s.node.slurm_node, s.node.k8s_node):
            if alias is not None:
                _match(NODE_NAME, alias, "node alias")
    for name in names:
        _match(NODE_NAME, name, "node name")
    if len(set(names)) > incident.world_size:
        raise IncidentFormatError(f"{len(set(names))} nodes named but world_size is {incident.world_size}")
    for check in incident.checks_failed:
        if check not in CHECKS:
            raise IncidentFormatError(f"field 'checks_failed' holds unknown check {check!r}")
    ckpt = incident.recommended_checkpoint
    if ckpt is not None:
        step, path = ckpt.get("step"), ckpt.get("path")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise IncidentFormatError("recommended_checkpoint 'step' must be a non-negative integer")
        if not isinstance(path, str):
            raise IncidentFormatError("recommended_checkpoint 'path' must be a string")
        _match(CHECKPOINT_PATH, path, "recommended_checkpoint path")
    when = _dt.datetime.fromisoformat(incident.time)
    if when.utcoffset() is None:
        raise IncidentFormatError(f"field 'time' needs a UTC offset: {incident.time!r}")
    reference = now or _reader_clock()
    if when - reference > MAX_TIME_SKEW:
        raise IncidentNotYetValidError(
            f"not yet valid: field 'time' {incident.time!r} is more than {MAX_TIME_SKEW.days} days ahead "
            f"of this reader's clock ({utc_iso(reference)}); a file is read again until it is valid"
        )


def _reader_clock() -> _dt.datetime:
    # One place for "now" of the time check (tests move it to play a clock that was wrong).
    return _dt.datetime.now(_dt.UTC)


def _match(pattern: re.Pattern[str], value: str, what: str) -> None:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        shown = value if not isinstance(value, str) else value[:80]
        raise IncidentFormatError(f"{what} {shown!r} does not match the incident grammar ({pattern.pattern})")


def _check_plain(data: Any, start: int = 0) -> None:
    # Iterative walk: bounded depth (asdict and json recurse) and strings SQLite can store.
    stack: list[tuple[Any, int]] = [(data, start)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _encodable(value)
        elif isinstance(value, (Mapping, list, tuple)):
            if depth >= MAX_EVIDENCE_DEPTH:
                raise IncidentFormatError(f"incident is nested deeper than {MAX_EVIDENCE_DEPTH} levels")
            if isinstance(value, Mapping):
                for key, item in value.items():
                    if isinstance(key, str):
                        _encodable(key)
                    elif not (key is None or isinstance(key, (bool, int, float))):
                        raise IncidentFormatError(f"object key {_short(key)} is not a JSON key")
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise IncidentFormatError("an integer in the incident does not fit in 64 bits")
        elif not (value is None or isinstance(value, (bool, int, float))):
            raise IncidentFormatError(f"a value of type {type(value).__name__} is not JSON")


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IncidentJSONError("incident holds a string that is not valid Unicode (lone surrogate)") from exc


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats become strings, tuples lists, keys strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def make_incident_id(job_id: str, step: int, check: str, attempt: str = "") -> str:
    """The id every rank computes for the same detection, so duplicates merge. ``attempt`` (a
    restarted job's ``r1``/``t2``...) keeps a restart's incident at the same step distinct."""
    return f"{job_id}-{attempt}-s{step}-{check}" if attempt else f"{job_id}-s{step}-{check}"


INCIDENT_FILE_MODE = 0o640
"""Default permissions of an incident file: the owner writes, the group (a controller running
as another user of the job's group) reads, others nothing."""


def write_incident(
    incident: Incident, directory: str | os.PathLike[str], *, mode: int = INCIDENT_FILE_MODE
) -> Path:
    """Write ``incident`` to ``directory`` atomically (temp file, fsync, link); return its path.

    An existing file is never overwritten: the same content again returns the existing path,
    a different incident under the same name goes to ``NAME.1.json``, ``NAME.2.json``... The
    file gets ``mode`` (default ``0o640``), whatever the umask."""
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
        raise ValueError(f"incident file mode must be permission bits 0..0o777, got {mode!r}")
    target_dir = Path(directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    body = incident.to_json()
    fd, tmp = tempfile.mkstemp(prefix=".incident-", suffix=".tmp", dir=target_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(body)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        target = _link_new(Path(tmp), target_dir, _safe_name(incident.id), body)
    finally:
        Path(tmp).unlink(missing_ok=True)
    dir_fd = os.open(target_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def _link_new(tmp: Path, directory: Path, stem: str, body: str) -> Path:
    """Hard-link ``tmp`` under the first free name (link never replaces an existing file)."""
    for n in range(10_000):
        target = directory / (f"{stem}.json" if n == 0 else f"{stem}.{n}.json")
        try:
            os.link(tmp, target)
            return target
        except FileExistsError:
            try:
                if target.read_text(encoding="utf-8") == body:
                    return target  # the same incident again (a retry): nothing new to keep
            except OSError:
                pass
    raise FileExistsError(f"{directory}: 10000 incident files named {stem}*.json already")


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


def _req_check(data: Mapping[str, Any]) -> Check:
    value = data.get("check")
    for choice in CHECKS:
        if value == choice:
            return choice
    raise IncidentFormatError(f"field 'check' must be one of {', '.join(CHECKS)}; got {_short(value)}")


def _req_classification(data: Mapping[str, Any]) -> Classification:
    value = data.get("classification")
    for choice in CLASSIFICATIONS:
        if value == choice:
            return choice
    raise IncidentFormatError(
        f"field 'classification' must be one of {', '.join(CLASSIFICATIONS)}; got {_short(value)}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
