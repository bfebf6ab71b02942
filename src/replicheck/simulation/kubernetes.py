"""A simulated Kubernetes API server for the demo and the tests; not a controller backend.

The product's ``kubernetes`` backend (``replicheck.controller.backends.kubernetes``) talks to
a real API server. None can run where replicheck is developed and tested, so this in-memory
stand-in serves the few endpoints that backend uses, answering the way the API server does:
JSON merge patches with a ``metadata.resourceVersion`` precondition (409 Conflict when stale),
404 for unknown objects, ``Status`` bodies on errors, Jobs that run a pod whose log a test
chooses. Every request is recorded (verb, path, query, content type, parsed body) so callers
can check exactly what a client sent. It binds 127.0.0.1 on a free port and speaks plain HTTP.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

MERGE_PATCH = "application/merge-patch+json"

JobRunner = Callable[[dict[str, Any]], tuple[bool, str]]
"""Given a created Job, whether its pod succeeds and the pod's log."""


@dataclass(frozen=True)
class Request:
    """One request as the fake server received it."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any
    """Parsed JSON body (None when there was none)."""


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    before: Callable[[], None] | None = None


@dataclass
class FakeCluster:
    """The objects the fake API server holds."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)
    version: int = 100


def make_node(
    name: str,
    *,
    group: str | None = None,
    ready: bool = True,
    hostname: str | None = None,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, Any]] | None = None,
    unschedulable: bool = False,
    internal_dns: str | None = None,
) -> dict[str, Any]:
    """A Node object shaped like the API server's."""
    node_labels = {"kubernetes.io/hostname": hostname or name, **(labels or {})}
    if group is not None:
        node_labels["sagemaker.amazonaws.com/instance-group-name"] = group
    addresses = [{"type": "Hostname", "address": hostname or name}]
    if internal_dns:
        addresses.append({"type": "InternalDNS", "address": internal_dns})
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = list(taints)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": node_labels, "annotations": {}},
        "spec": spec,
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "addresses": addresses,
        },
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeApiServer:
    """The HTTP server. Use as a context manager; ``url`` is its address."""

    def __init__(
        self,
        *,
        job_runner: JobRunner | None = None,
        token: str | None = None,
        clock: Callable[[], _dt.datetime] | None = None,
    ) -> None:
        self.cluster = FakeCluster()
        self.clock = clock or (lambda: _dt.datetime.now(_dt.UTC))
        """Time stamped on created objects (share the controller's clock in tests)."""
        self.requests: list[Request] = []
        self.token = token
        self.job_runner: JobRunner = job_runner or (lambda job: (True, ""))
        self.job_polls_until_done = 1
        """GETs of a new Job that still show it running (0: finished on the first read)."""
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self._polls: dict[tuple[str, str], int] = {}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeApiServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-kube-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- test controls ----------------------------------------------------------------------

    def add_node(self, node: dict[str, Any]) -> None:
        with self._lock:
            self.cluster.version += 1
            node = copy.deepcopy(node)
            node["metadata"]["resourceVersion"] = str(self.cluster.version)
            node["metadata"].setdefault("creationTimestamp", _stamp(self.clock()))
            self.cluster.nodes[node["metadata"]["name"]] = node

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.cluster.nodes[name])

    def edit_node(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Change a node as another client would (bumps its resourceVersion)."""
        with self._lock:
            change(self.cluster.nodes[name])
            self.cluster.version += 1
            self.cluster.nodes[name]["metadata"]["resourceVersion"] = str(self.cluster.version)

    def remove_node(self, name: str) -> None:
        with self._lock:
            self.cluster.nodes.pop(name, None)

    def fail(
        self,
        method: str,
        path_regex: str,
        status: int,
        times: int = 1,
        before: Callable[[], None] | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with ``status``; ``before`` runs first
        (with status 0 the request is then served normally: a concurrent change, for example)."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), status, times, before))

    def count(self, method: str, path_regex: str = ".*") -> int:
        """How many requests with this verb hit a path matching ``path_regex``."""
        pattern = re.compile(path_regex)
        return sum(1 for r in self.requests if r.method == method and pattern.fullmatch(r.path))

    # --- serving ----------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def _serve(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                req = Request(
                    self.command,
                    parts.path,
                    dict(parse_qsl(parts.query)),
                    self.headers.get("Content-Type"),
                    body,
                )
                status, payload = server._dispatch(req, self.headers.get("Authorization"))
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                ctype = "text/plain" if isinstance(payload, str) else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

        return Handler

    def _dispatch(self, req: Request, auth: str | None) -> tuple[int, Any]:
        with self._lock:
            self.requests.append(req)
            if self.token is not None and auth != f"Bearer {self.token}":
                return _status(401, "Unauthorized", "Unauthorized")
            for fault in self._faults:
                if fault.times > 0 and fault.method == req.method and fault.path.fullmatch(req.path):
                    fault.times -= 1
                    if fault.before is not None:
                        fault.before()
                    if fault.status != 0:
                        return _status(
                            fault.status,
                            _REASONS.get(fault.status, "InternalError"),
                            f"injected {fault.status}",
                        )
            return self._route(req)

    def _route(self, req: Request) -> tuple[int, Any]:
        p, c = req.path, self.cluster
        if p == "/api/v1/nodes" and req.method == "GET":
            return 200, _list("NodeList", list(c.nodes.values()), str(c.version))
        m = re.fullmatch(r"/api/v1/nodes/([^/]+)", p)
        if m:
            return self._node(req, m.group(1))
        if p == "/api/v1/pods" and req.method == "GET":
            return 200, _list("PodList", self._select_pods(None, req.query), str(c.version))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", p)
        if m and req.method == "GET":
            return 200, _list("PodList", self._select_pods(m.group(1), req.query), str(c.version))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", p)
        if m and req.method == "GET":
            key = (m.group(1), m.group(2))
            if key not in c.pods:
                return _status(404, "NotFound", f'pods "{key[1]}" not found')
            return 200, c.logs.get(key, "")
        m = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs", p)
        if m and req.method == "POST":
            return self._create_job(m.group(1), req)
        m = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)", p)
        if m:
            return self._job(req, m.group(1), m.group(2))
        return _status(404, "NotFound", f"the server could not find the requested resource ({p})")

    def _node(self, req: Request, name: str) -> tuple[int, Any]:
        node = self.cluster.nodes.get(name)
        if node is None:
            return _status(404, "NotFound", f'nodes "{name}" not found')
        if req.method == "GET":
            return 200, copy.deepcopy(node)
        if req.method != "PATCH":
            return _status(405, "MethodNotAllowed", f"{req.method} not allowed")
        if req.content_type != MERGE_PATCH:
            # The real server accepts other patch types; this one implements merge patch only,
            # so anything else is a client bug worth failing loudly on.
            return _status(
                415, "UnsupportedMediaType", f"fake server only takes {MERGE_PATCH}, got {req.content_type}"
            )
        if not isinstance(req.body, dict):
            return _status(400, "BadRequest", "patch body must be a JSON object")
        wanted = (req.body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on nodes "{name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
            )
        patched = merge_patch(node, req.body)
        self.cluster.version += 1
        patched["metadata"]["resourceVersion"] = str(self.cluster.version)
        self.cluster.nodes[name] = patched
        return 200, copy.deepcopy(patched)

    def _create_job(self, namespace: str, req: Request) -> tuple[int, Any]:
        job = req.body
        if req.content_type != "application/json":
            return _status(
                415,
                "UnsupportedMediaType",
                f"fake server only takes application/json, got {req.content_type}",
            )
        if not isinstance(job, dict) or not isinstance(job.get("metadata"), dict):
            return _status(400, "BadRequest", "job body must be an object with metadata")
        name = job["metadata"].get("name")
        if not name:
            return _status(422, "Invalid", "metadata.name: Required value")
        if (namespace, name) in self.cluster.jobs:
            return _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        job = copy.deepcopy(job)
        self.cluster.version += 1
        job["metadata"].update(
            namespace=namespace,
            uid=f"uid-job-{name}",
            resourceVersion=str(self.cluster.version),
            creationTimestamp=_stamp(self.clock()),
        )
        job["status"] = {"active": 1}
        self.cluster.jobs[(namespace, name)] = job
        self._polls[(namespace, name)] = self.job_polls_until_done
        return 201, copy.deepcopy(job)

    def _job(self, req: Request, namespace: str, name: str) -> tuple[int, Any]:
        key = (namespace, name)
        job = self.cluster.jobs.get(key)
        if job is None:
            return _status(404, "NotFound", f'jobs.batch "{name}" not found')
        if req.method == "DELETE":
            del self.cluster.jobs[key]
            for pod_key in [
                k
                for k, pod in self.cluster.pods.items()
                if k[0] == namespace and pod["metadata"]["labels"].get("job-name") == name
            ]:
                del self.cluster.pods[pod_key]
                self.cluster.logs.pop(pod_key, None)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if req.method != "GET":
            return _status(405, "MethodNotAllowed", f"{req.method} not allowed")
        if self._polls.get(key, 0) > 0:
            self._polls[key] -= 1
        elif "succeeded" not in job["status"] and "failed" not in job["status"]:
            self._finish(namespace, name, job)
        return 200, copy.deepcopy(job)

    def _finish(self, namespace: str, name: str, job: dict[str, Any]) -> None:
        ok, log = self.job_runner(job)
        pod_name = f"{name}-x1"
        labels = {"job-name": name, "batch.kubernetes.io/job-name": name}
        pod_spec = job["spec"]["template"]["spec"]
        self.cluster.pods[(namespace, pod_name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": namespace,
                "labels": labels,
                "creationTimestamp": "2025-01-01T00:00:01Z",
            },
            "spec": copy.deepcopy(pod_spec),
            "status": {"phase": "Succeeded" if ok else "Failed"},
        }
        self.cluster.logs[(namespace, pod_name)] = log
        job["status"] = {"succeeded": 1} if ok else {"failed": 1}
        job["status"]["conditions"] = [{"type": "Complete" if ok else "Failed", "status": "True"}]

    def _select_pods(self, namespace: str | None, query: dict[str, str]) -> list[dict[str, Any]]:
        labels = dict(pair.split("=", 1) for pair in query.get("labelSelector", "").split(",") if "=" in pair)
        fields = dict(pair.split("=", 1) for pair in query.get("fieldSelector", "").split(",") if "=" in pair)
        out = []
        for (ns, name), pod in sorted(self.cluster.pods.items()):
            if namespace is not None and ns != namespace:
                continue
            if any(pod["metadata"]["labels"].get(k) != v for k, v in labels.items()):
                continue
            if "metadata.name" in fields and name != fields["metadata.name"]:
                continue
            out.append(copy.deepcopy(pod))
        return out

    def add_pod(
        self,
        namespace: str,
        name: str,
        node_name: str,
        *,
        labels: dict[str, str] | None = None,
        phase: str = "Running",
    ) -> None:
        """A pod (e.g. a training rank) on ``node_name``; ``labels={"job-name": J}`` makes it a
        pod of Job J, ``phase="Failed"`` a finished one."""
        with self._lock:
            self.cluster.pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
                "spec": {"nodeName": node_name},
                "status": {"phase": phase},
            }

    def add_job(self, namespace: str, job: dict[str, Any]) -> None:
        """A Job created by someone else (e.g. the training job the controller resumes)."""
        with self._lock:
            job = copy.deepcopy(job)
            job["metadata"]["namespace"] = namespace
            self.cluster.jobs[(namespace, job["metadata"]["name"])] = job
            self._polls[(namespace, job["metadata"]["name"])] = 10**9


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _stamp(when: _dt.datetime) -> str:
    """The API server's timestamp format: RFC 3339, whole seconds, UTC."""
    return when.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> tuple[int, Any]:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _list(kind: str, items: list[dict[str, Any]], version: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "apiVersion": "v1",
        "metadata": {"resourceVersion": version},
        "items": [copy.deepcopy(i) for i in items],
    }
