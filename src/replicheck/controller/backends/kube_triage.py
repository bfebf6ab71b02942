"""Jobs the ``kubernetes`` backend creates: the pinned self-test (triage) and the re-created
training Job (resume). Names derive from the action key, so a repeat after a crash finds the
Job it created before instead of creating a second one."""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from replicheck.controller.backends.base import ResumeRequest
from replicheck.controller.backends.kube_api import KubeApi, KubeConflict, KubeNotFound
from replicheck.controller.errors import NotYet, PermanentBackendError

if TYPE_CHECKING:
    from replicheck.controller.backends.kube_config import KubernetesConfig

APP_LABEL = "app.kubernetes.io/name"
KEY_ANNOTATION = "replicheck.io/action-key"
_CONTROLLER_LABELS = (
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "job-name",
    "batch.kubernetes.io/job-name",
)
GRACE_S = 120
"""Extra time past activeDeadlineSeconds before a Job without a result counts as lost."""


def job_name(prefix: str, key: str, role: str = "") -> str:
    """A DNS-label Job name unique to (key, role): prefix, role and a hash of the key."""
    digest = hashlib.sha256(f"{key}|{role}".encode()).hexdigest()[:10]
    return "-".join(p for p in (prefix, role, digest) if p)[:63]


def selftest_job(config: KubernetesConfig, node: Mapping[str, Any], name: str, key: str) -> dict[str, Any]:
    """A one-pod Job running the self-test on ``node`` only, tolerating our cordon."""
    node_name = str(node["metadata"]["name"])
    labels = {APP_LABEL: "replicheck-selftest"}
    container: dict[str, Any] = {
        "name": "selftest",
        "image": config.triage_image,
        "command": [*config.triage_command, "--node", node_name],
    }
    if config.triage_gpu_resource:
        container["resources"] = {"limits": {config.triage_gpu_resource: "1"}}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
                    ]
                }
            }
        },
        "tolerations": [
            {"key": config.taint_key, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "containers": [container],
    }
    hostname = ((node.get("metadata") or {}).get("labels") or {}).get("kubernetes.io/hostname")
    if hostname:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": hostname}
    if config.triage_service_account:
        pod_spec["serviceAccountName"] = config.triage_service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KEY_ANNOTATION: key, "replicheck.io/node": node_name},
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(config.triage_timeout_s),
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def run(
    api: KubeApi,
    config: KubernetesConfig,
    suspect: Mapping[str, Any],
    reference: Mapping[str, Any],
    key: str,
    now: _dt.datetime,
) -> Mapping[str, Any]:
    """Self-test ``suspect`` and ``reference`` as two Jobs; NotYet until both finished, then
    compare fingerprints and delete the Jobs."""
    ns = config.triage_namespace
    jobs = {
        role: (job_name("replicheck-selftest", key, role), node)
        for role, node in (("suspect", suspect), ("reference", reference))
    }
    states = {}
    for role, (name, node) in jobs.items():
        states[role] = _ensure(api, ns, selftest_job(config, node, name, key))
    waiting = [r for r, job in states.items() if not _finished(job)]
    if waiting:
        started = min(_created(states[r], now) for r in waiting)
        if (now - started).total_seconds() > config.triage_timeout_s + GRACE_S:
            _cleanup(api, ns, [name for name, _ in jobs.values()])
            raise PermanentBackendError(
                f"self-test Job(s) {', '.join(jobs[r][0] for r in waiting)} gave no "
                f"result within {config.triage_timeout_s}s"
            )
        raise NotYet("self-test running: " + ", ".join(jobs[r][0] for r in waiting))
    try:
        results = {role: _result(api, ns, name, states[role]) for role, (name, _) in jobs.items()}
    finally:
        _cleanup(api, ns, [name for name, _ in jobs.values()])
    mine, theirs = results["suspect"]["fingerprint"], results["reference"]["fingerprint"]
    suspect_name, ref_name = str(suspect["metadata"]["name"]), str(reference["metadata"]["name"])
    verdict = "matches" if mine == theirs else "differs from"
    return {
        "passed": mine == theirs,
        "fingerprint": mine,
        "reference": ref_name,
        "reference_fingerprint": theirs,
        "detail": f"{suspect_name}: fingerprint {mine} {verdict} {ref_name}'s {theirs}",
    }


def _ensure(api: KubeApi, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    try:
        return api.read_job(ns, name)
    except KubeNotFound:
        pass
    try:
        return api.create_job(ns, body)
    except KubeConflict:
        return api.read_job(ns, name)


def _finished(job: Mapping[str, Any]) -> bool:
    status = job.get("status") or {}
    if status.get("succeeded") or status.get("failed"):
        return True
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _created(job: Mapping[str, Any], now: _dt.datetime) -> _dt.datetime:
    stamp = (job.get("metadata") or {}).get("creationTimestamp")
    try:
        return _dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return now


def _result(api: KubeApi, ns: str, name: str, job: Mapping[str, Any]) -> dict[str, Any]:
    pods = sorted(api.job_pods(ns, name), key=lambda p: str(p["metadata"].get("creationTimestamp", "")))
    log = api.pod_log(ns, pods[-1]["metadata"]["name"]) if pods else ""
    for line in reversed(log.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("fingerprint"), str):
            return data
    state = "failed" if (job.get("status") or {}).get("failed") else "finished"
    raise PermanentBackendError(
        f"self-test Job {name} {state} without a result: {log.strip()[-300:] or 'no output'}"
    )


def _cleanup(api: KubeApi, ns: str, names: list[str]) -> None:
    for name in names:
        api.delete_job(ns, name)


# --- resume by re-creating the training Job ---------------------------------------------------


def recreate_job(
    api: KubeApi, config: KubernetesConfig, request: ResumeRequest, key: str
) -> Mapping[str, Any]:
    """Create a copy of the training Job that resumes from the checkpoint (once per key)."""
    ns, _, name = request.job_id.rpartition("/")
    ns = ns or config.job_namespace
    new_name = job_name(name[:40], key, "resume")
    try:
        api.read_job(ns, new_name)
        return {"detail": f"already re-created as job {ns}/{new_name}", "job_id": f"{ns}/{new_name}"}
    except KubeNotFound:
        pass
    try:
        old = api.read_job(ns, name)
    except KubeNotFound as exc:
        raise PermanentBackendError(
            f"training job {ns}/{name} not found; set resume_mode=job-restart "
            "or name the Job in REPLICHECK_JOB_ID as namespace/name"
        ) from exc
    body = _resumed_copy(old, new_name, request, key)
    try:
        api.create_job(ns, body)
    except KubeConflict:
        return {"detail": f"already re-created as job {ns}/{new_name}", "job_id": f"{ns}/{new_name}"}
    step = (request.checkpoint or {}).get("step")
    return {
        "detail": f"re-created job {ns}/{name} as {new_name} from step {step}",
        "job_id": f"{ns}/{new_name}",
    }


def _resumed_copy(old: Mapping[str, Any], new_name: str, request: ResumeRequest, key: str) -> dict[str, Any]:
    ckpt = request.checkpoint or {}
    env = {
        "REPLICHECK_RESUME_STEP": str(ckpt.get("step", "")),
        "REPLICHECK_RESUME_CHECKPOINT": str(ckpt.get("path", "")),
    }
    annotations = {
        "replicheck.io/resumed-from": str((old.get("metadata") or {}).get("name")),
        "replicheck.io/incident": request.incident_id,
    }
    return job_copy(old, new_name, key, env=env, labels={}, annotations=annotations)


def job_copy(
    old: Mapping[str, Any],
    new_name: str,
    key: str,
    *,
    env: Mapping[str, str],
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
) -> dict[str, Any]:
    """A new Job from ``old``: without what the API server sets (selector, controller labels),
    with ``env`` set in every container, ``labels`` on the Job and its pods, the action key and
    ``annotations`` on the Job."""
    meta = old.get("metadata") or {}
    spec = copy.deepcopy(dict(old.get("spec") or {}))
    # The API server derives these for the new Job; copying them would be rejected.
    spec.pop("selector", None)
    spec.pop("manualSelector", None)
    template = spec.setdefault("template", {})
    tmeta = template.setdefault("metadata", {})
    kept_labels = {k: v for k, v in (tmeta.get("labels") or {}).items() if k not in _CONTROLLER_LABELS}
    tmeta["labels"] = {**kept_labels, **labels}
    for container in (template.get("spec") or {}).get("containers") or []:
        kept = [e for e in container.get("env") or [] if e.get("name") not in env]
        container["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    job_labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in _CONTROLLER_LABELS}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": new_name,
            "labels": {**job_labels, **labels},
            "annotations": {KEY_ANNOTATION: key, **annotations},
        },
        "spec": spec,
    }
