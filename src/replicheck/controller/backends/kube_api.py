"""The Kubernetes calls the ``kubernetes`` backend makes, through the official client, with
API errors sorted the way the executor needs them: 404 and 403 (and other 4xx) permanent,
409 a conflict the caller re-reads and retries, 429/5xx and connection trouble temporary.

Objects are handled as plain JSON dicts (``_preload_content=False``) so the backend sees
exactly what the API server sent and does not depend on the client's model classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from replicheck.controller.backends.extras import missing_extra
from replicheck.controller.errors import PermanentBackendError, TransientBackendError

MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"
EXTRA = "kubernetes"


class KubeNotFound(PermanentBackendError):
    """The object does not exist (404)."""


class KubeConflict(TransientBackendError):
    """The object changed since it was read (409 on update) or already exists (409 on create)."""


def import_client() -> Any:
    """The ``kubernetes`` package, or a clear error naming the extra that installs it."""
    try:
        import kubernetes
    except ImportError as exc:
        raise missing_extra("kubernetes backend", "kubernetes", EXTRA) from exc
    return kubernetes


class KubeApi:
    """Thin JSON-in, JSON-out wrapper over CoreV1Api and BatchV1Api."""

    def __init__(self, api_client: Any, timeout_s: float) -> None:
        k8s = import_client()
        self._core = k8s.client.CoreV1Api(api_client)
        self._batch = k8s.client.BatchV1Api(api_client)
        self._api_exception = k8s.client.exceptions.ApiException
        self._timeout = timeout_s

    # --- nodes ------------------------------------------------------------------------------

    def read_node(self, name: str) -> dict[str, Any]:
        return self._json(f"node {name}", self._core.read_node, name)

    def list_nodes(self) -> list[dict[str, Any]]:
        return list(self._json("nodes", self._core.list_node).get("items") or [])

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch; include ``metadata.resourceVersion`` to make it conditional."""
        return self._json(f"node {name}", self._core.patch_node, name, body, _content_type=MERGE_PATCH)

    # --- pods and jobs ----------------------------------------------------------------------

    def pods_named(self, name: str) -> list[dict[str, Any]]:
        """Pods of any namespace called ``name`` (a training rank's host name is its pod name)."""
        data = self._json(
            "pods", self._core.list_pod_for_all_namespaces, field_selector=f"metadata.name={name}"
        )
        return list(data.get("items") or [])

    def job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        data = self._json(
            f"pods of job {job}", self._core.list_namespaced_pod, namespace, label_selector=f"job-name={job}"
        )
        return list(data.get("items") or [])

    def pod_log(self, namespace: str, pod: str) -> str:
        return self._call(f"log of pod {pod}", self._core.read_namespaced_pod_log, pod, namespace).decode(
            "utf-8", "replace"
        )

    def read_job(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(f"job {namespace}/{name}", self._batch.read_namespaced_job, name, namespace)

    def create_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name")
        return self._json(
            f"job {namespace}/{name}",
            self._batch.create_namespaced_job,
            namespace,
            body,
            _headers={"Content-Type": JSON},
        )

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and (in the background) its pods; a Job already gone is fine."""
        try:
            self._call(
                f"job {namespace}/{name}",
                self._batch.delete_namespaced_job,
                name,
                namespace,
                body={"propagationPolicy": "Background"},
                _headers={"Content-Type": JSON},
            )
        except KubeNotFound:
            pass

    # --- plumbing ---------------------------------------------------------------------------

    def _json(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        raw = self._call(what, fn, *args, **kwargs)
        try:
            data = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise TransientBackendError(f"{what}: the API server sent no JSON: {raw[:200]!r}") from exc
        if not isinstance(data, dict):
            raise TransientBackendError(f"{what}: unexpected answer {str(data)[:200]}")
        return data

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
        import urllib3

        try:
            response = fn(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
        except self._api_exception as exc:
            raise classify(int(exc.status or 0), what, _message(exc.body, exc.reason)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientBackendError(f"{what}: API server unreachable: {exc}") from exc
        data = response.data
        return bytes(data) if data is not None else b""


def classify(status: int, what: str, message: str) -> TransientBackendError | PermanentBackendError:
    """The backend error for an API status code."""
    text = f"{what}: {status} {message}"
    if status == 404:
        return KubeNotFound(text)
    if status == 409:
        return KubeConflict(text)
    if status in (401, 403):
        return PermanentBackendError(f"{text} (check the controller's RBAC: deploy/rbac.yaml)")
    if status == 429 or status >= 500 or status == 0:
        return TransientBackendError(text)
    return PermanentBackendError(text)


def _message(body: Any, reason: Any) -> str:
    try:
        data = json.loads(body) if body else {}
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
    except (TypeError, ValueError):
        pass
    return str(reason or "error")
