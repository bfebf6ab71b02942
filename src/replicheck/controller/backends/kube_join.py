"""The Kubernetes join action: one replacement torchft replica group, as a copy of the departed
group's Job (``docs/no-restart.md``, "The controller's join action"). The job never stopped, so
nothing else is touched."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from replicheck.controller.backends.base import JoinRequest
from replicheck.controller.backends.kube_api import KubeApi, KubeConflict, KubeNotFound
from replicheck.controller.backends.kube_config import KubernetesConfig
from replicheck.controller.backends.kube_triage import _CONTROLLER_LABELS, KEY_ANNOTATION, job_name
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
    meta = old.get("metadata") or {}
    spec = copy.deepcopy(dict(old.get("spec") or {}))
    # The API server derives these for the new Job; copying them would be rejected.
    spec.pop("selector", None)
    spec.pop("manualSelector", None)
    template = spec.setdefault("template", {})
    tmeta = template.setdefault("metadata", {})
    group_labels = {JOIN_LABEL: hashlib.sha256(key.encode()).hexdigest()[:16]}
    if len(request.replica_group) <= 63 and request.replica_group[-1].isalnum():
        group_labels[GROUP_LABEL] = request.replica_group  # a valid label value
    tmeta["labels"] = {
        **{k: v for k, v in (tmeta.get("labels") or {}).items() if k not in _CONTROLLER_LABELS},
        **group_labels,
    }
    for container in (template.get("spec") or {}).get("containers") or []:
        kept = [e for e in container.get("env") or [] if e.get("name") != GROUP_ENV]
        container["env"] = [*kept, {"name": GROUP_ENV, "value": request.replica_group}]
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in _CONTROLLER_LABELS}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": new_name,
            "labels": {**labels, **group_labels},
            "annotations": {
                KEY_ANNOTATION: key,
                "replicheck.io/joins-for": str(meta.get("name")),
                "replicheck.io/replica-group": request.replica_group,
                "replicheck.io/incident": request.incident_id,
            },
        },
        "spec": spec,
    }
