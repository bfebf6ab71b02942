"""The Kubernetes join action: one replacement torchft replica group, as a copy of the departed
group's Job (``docs/no-restart.md``, "The controller's join action"). The job never stopped, so
nothing else is touched."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from replicheck.controller.backends.base import JoinRequest
from replicheck.controller.backends.kube_api import KubeApi, KubeConflict, KubeNotFound
from replicheck.controller.backends.kube_config import KubernetesConfig
from replicheck.controller.backends.kube_triage import job_copy, job_name
from replicheck.controller.errors import PermanentBackendError
from replicheck.incident import INCIDENT_ID, REPLICA_GROUP

GROUP_ENV = "REPLICA_GROUP_ID"
"""The environment variable a replica group's containers read their group id from."""
GROUP_LABEL = "replicheck.io/replica-group"
JOIN_LABEL = "replicheck.io/join"


def join_group(api: KubeApi, config: KubernetesConfig, request: JoinRequest, key: str) -> Mapping[str, Any]:
    """Create ``<departed Job>-join-<hash of key>``: the departed group's Job with
    ``REPLICA_GROUP_ID`` set, once per key (a repeat finds it, a racing create gets 409)."""
    for pattern, value, what in (
        (REPLICA_GROUP, request.replica_group, "replica group"),
        (INCIDENT_ID, request.incident_id, "incident id"),
    ):
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise PermanentBackendError(f"refusing {what} {value!r} in a Job")
    ns, _, name = request.job_id.rpartition("/")
    ns = ns or config.job_namespace
    new_name = job_name(name[:40], key, "join")
    try:
        api.read_job(ns, new_name)
        return _started(ns, new_name, request, already=True)
    except KubeNotFound:
        pass
    try:
        old = api.read_job(ns, name)
    except KubeNotFound as exc:
        raise PermanentBackendError(
            f"the departed replica group's Job {ns}/{name} is not found (deleted?): the join copies "
            f"it; start a replacement for replica group {request.replica_group} by hand"
        ) from exc
    try:
        api.create_job(ns, _joining_copy(old, new_name, request, key))
    except KubeConflict:
        return _started(ns, new_name, request, already=True)
    return _started(ns, new_name, request, already=False)


def _started(ns: str, name: str, request: JoinRequest, *, already: bool) -> dict[str, Any]:
    verb = "already started" if already else "started"
    return {
        "detail": f"{verb} a replacement for replica group {request.replica_group} of job "
        f"{request.job_id} as job {ns}/{name}",
        "job_id": f"{ns}/{name}",
        "replica_group": request.replica_group,
    }


def _joining_copy(old: Mapping[str, Any], new_name: str, request: JoinRequest, key: str) -> dict[str, Any]:
    labels = {JOIN_LABEL: hashlib.sha256(key.encode()).hexdigest()[:16]}
    if len(request.replica_group) <= 63 and request.replica_group[-1].isalnum():
        labels[GROUP_LABEL] = request.replica_group  # a valid label value
    annotations = {
        "replicheck.io/joins-for": str((old.get("metadata") or {}).get("name")),
        "replicheck.io/replica-group": request.replica_group,
        "replicheck.io/incident": request.incident_id,
    }
    return job_copy(
        old, new_name, key, env={GROUP_ENV: request.replica_group}, labels=labels, annotations=annotations
    )
