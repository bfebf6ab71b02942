"""``kubernetes``: cordon with ``spec.unschedulable`` plus a ``NoSchedule`` taint and our own
labels/annotations, replace through HyperPod's node-health label (or a label/annotation for
another remediator), triage with a pinned self-test Job, resume through the training job's
own restart policy or a re-created Job.

Every node change is one JSON merge patch carrying the ``resourceVersion`` it was computed
from, so a concurrent writer makes it fail with 409 and it is recomputed from a fresh read;
what we added is written on the node (``replicheck.io/cordon-added``) so uncordon removes
exactly that. Each call observes the node first, which makes a repeat after a crash a no-op.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from replicheck.controller.backends import kube_triage
from replicheck.controller.backends.base import JoinRequest, NodeInfo, ResumeRequest, validate_node_name
from replicheck.controller.backends.kube_api import KubeApi, KubeConflict, KubeNotFound, import_client
from replicheck.controller.backends.kube_config import (
    ANN_ADDED,
    ANN_AT,
    ANN_BY,
    ANN_INCIDENT,
    ANN_REASON,
    ANN_REPLACE_AT,
    ANN_REPLACE_KEY,
    CORDON_ANNOTATIONS,
    HEALTH_LABEL,
    LABEL_CORDONED,
    PENDING_REBOOT,
    PENDING_REPLACEMENT,
    REMEDIATIONS,
    RESUME_MODES,
    UNSCHEDULABLE_TAINT,
    KubernetesConfig,
)
from replicheck.controller.errors import (
    ConfigError,
    JoinNotBuiltError,
    NotYet,
    PermanentBackendError,
    TransientBackendError,
)
from replicheck.timefmt import utc_iso_us

# The config and the names written on nodes live in kube_config; importable from here too.
__all__ = [
    "KubernetesBackend",
    "ANN_ADDED",
    "ANN_AT",
    "ANN_BY",
    "ANN_INCIDENT",
    "ANN_REASON",
    "ANN_REPLACE_AT",
    "ANN_REPLACE_KEY",
    "CORDON_ANNOTATIONS",
    "HEALTH_LABEL",
    "LABEL_CORDONED",
    "PENDING_REBOOT",
    "PENDING_REPLACEMENT",
    "REMEDIATIONS",
    "RESUME_MODES",
    "UNSCHEDULABLE_TAINT",
    "KubernetesConfig",
]


class KubernetesBackend:
    """The Backend protocol on a Kubernetes cluster (EKS under HyperPod or any other)."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig | None = None,
        api_client: Any = None,
        clock: Callable[[], _dt.datetime] | None = None,
    ) -> None:
        """``api_client``: a ``kubernetes.client.ApiClient`` (default: built from ``config``)."""
        self.config = config or KubernetesConfig()
        self.api = KubeApi(
            api_client if api_client is not None else _api_client(self.config), self.config.request_timeout_s
        )
        self._clock = clock or (lambda: _dt.datetime.now(_dt.UTC))
        self._requested: dict[str, tuple[str, _dt.datetime]] = {}

    # --- observation ------------------------------------------------------------------------

    def node(self, node: str) -> dict[str, Any]:
        """The Node object for an incident's node name (node name, host name or pod name)."""
        validate_node_name(node)
        try:
            return self.api.read_node(node)
        except KubeNotFound:
            pass
        matches = [n for n in self.api.list_nodes() if node in _aliases(n)]
        if not matches and self.config.pod_lookup:
            on = {p.get("spec", {}).get("nodeName") for p in self.api.pods_named(node)} - {None}
            matches = [self.api.read_node(str(n)) for n in sorted(on)]
        if len(matches) > 1:
            names = ", ".join(sorted(_name(n) for n in matches))
            raise PermanentBackendError(f"{node!r} matches several Kubernetes nodes: {names}")
        if not matches:
            raise KubeNotFound(f"no Kubernetes node matches {node!r} (node name, host name or pod name)")
        return matches[0]

    def list_nodes(self) -> list[NodeInfo]:
        return sorted((self._info(n) for n in self.api.list_nodes()), key=lambda i: i.name)

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The nodes the Job's pods were placed on (finished pods included, while they exist),
        under their node names and host-name aliases, plus the pods' own names (a rank's host
        name is its pod name). ``job_id`` is ``namespace/name`` (or a name in ``job_namespace``).
        None when no pod of that Job exists."""
        ns, _, name = job_id.rpartition("/")
        pods = self.api.job_pods(ns or self.config.job_namespace, name)
        if not pods:
            return None
        names: set[str] = set()
        for pod in pods:
            names.add(_name(pod))
            on = (pod.get("spec") or {}).get("nodeName")
            if not on:
                continue  # not scheduled yet: no node of the cluster is its
            names.add(str(on))
            try:
                names |= _aliases(self.api.read_node(str(on)))
            except KubeNotFound:
                pass  # the node is gone (replaced); its name is still the pod's record
        return frozenset(names)

    def schedulable_by_partition(self, node: str) -> Mapping[str, Sequence[str]]:
        obj = self.node(node)
        mine, resolved = self._group(obj), _name(obj)
        # Report the node under the name the caller used (a host name may stand for it), so
        # the last-node rule recognises it.
        return {
            mine: [
                node if i.name == resolved else i.name
                for i in self.list_nodes()
                if mine in i.partitions and i.schedulable
            ]
        }

    # --- node actions -----------------------------------------------------------------------

    def cordon(self, node: str, reason: str, key: str) -> Mapping[str, Any]:
        def change(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            name, ann = _name(obj), _meta(obj, "annotations")
            if ANN_ADDED in ann:
                return None, f"{name} already cordoned by replicheck ({ann.get(ANN_INCIDENT, '?')})"
            spec = obj.get("spec") or {}
            added: list[str] = []
            patch_spec: dict[str, Any] = {}
            taints = list(spec.get("taints") or [])
            if not any(t.get("key") == self.config.taint_key for t in taints):
                added.append("taint")
                patch_spec["taints"] = taints + [
                    {"key": self.config.taint_key, "value": "true", "effect": "NoSchedule"}
                ]
            if not spec.get("unschedulable"):
                added.append("unschedulable")
                patch_spec["unschedulable"] = True
            annotations = {
                ANN_BY: self.config.actor,
                ANN_INCIDENT: _incident_of(key),
                ANN_AT: utc_iso_us(self._clock()),
                ANN_REASON: reason,
                ANN_ADDED: ",".join(added),
            }
            body: dict[str, Any] = {
                "metadata": {"labels": {LABEL_CORDONED: "true"}, "annotations": annotations}
            }
            if patch_spec:
                body["spec"] = patch_spec
            was = "" if "unschedulable" in added else " (it was already unschedulable: left so on uncordon)"
            return body, f"cordoned {name}: unschedulable, taint {self.config.taint_key}:NoSchedule{was}"

        return self._patch_node(node, change)

    def uncordon(self, node: str, reason_prefix: str, key: str) -> Mapping[str, Any]:
        def change(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            name, ann = _name(obj), _meta(obj, "annotations")
            if ANN_ADDED not in ann:
                return None, f"{name} left as is: not cordoned by replicheck"
            return _uncordon_patch(
                obj, self.config.taint_key
            ), f"uncordoned {name} (removed {ann[ANN_ADDED] or 'marks'})"

        try:
            return self._patch_node(node, change)
        except KubeNotFound:
            return {"detail": f"{node} is gone: nothing to uncordon"}

    def replace(self, node: str, key: str) -> Mapping[str, Any]:
        mode = self.config.remediation
        if mode == "none":
            return {"detail": f"remediation=none: {node} stays cordoned for a person to replace"}

        def change(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            name, marker = _name(obj), _label_safe(key)
            where, rkey, value = self._remediation()
            if _meta(obj, "annotations").get(ANN_REPLACE_KEY) == marker:
                self._remember(node, obj)
                return None, f"{name}: replacement already requested by this action"
            if _meta(obj, where).get(rkey) == value:
                return None, f"{name} already has {rkey}={value}"
            at = self._clock()
            self._requested[node] = (self._group(obj), at)
            meta: dict[str, Any] = {"annotations": {ANN_REPLACE_KEY: marker, ANN_REPLACE_AT: utc_iso_us(at)}}
            meta.setdefault(where, {})[rkey] = value
            return {"metadata": meta}, f"set {rkey}={value} on {name}"

        try:
            return self._patch_node(node, change)
        except KubeNotFound:
            return {"detail": f"{node} is gone: already replaced or removed"}

    def await_return(self, node: str, key: str) -> Mapping[str, Any]:
        if self.config.remediation == "none":
            return {"back": False, "replacement": None, "detail": f"remediation=none: {node} not replaced"}
        try:
            obj = self.node(node)
        except KubeNotFound:
            return self._replacement(node)
        name, ann = _name(obj), _meta(obj, "annotations")
        self._remember(node, obj)
        where, rkey, value = self._remediation()
        now = _meta(obj, where).get(rkey, "")
        if now == value or (rkey == HEALTH_LABEL and now.startswith("Unschedulable")):
            raise NotYet(f"{name}: {rkey}={now}")
        if not _ready(obj):
            raise NotYet(f"{name} is not Ready")
        if ANN_REPLACE_KEY in ann or ANN_ADDED in ann:
            # Same Node object, health reset by the remediator (a reboot): lift our cordon so
            # the node takes work again; a new object carries none of our marks.
            self._patch_node(
                name, lambda o: (_uncordon_patch(o, self.config.taint_key, replace_marks=True), "lifted")
            )
        return {"back": True, "replacement": None, "detail": f"{name} is Ready and schedulable"}

    def _remember(self, node: str, obj: dict[str, Any]) -> None:
        """Note the group and request time of a node we asked to replace (read back from its
        annotation, so a restarted controller that sees the node once knows them too)."""
        at = _parse_time(_meta(obj, "annotations").get(ANN_REPLACE_AT))
        if at is not None:
            self._requested[node] = (self._group(obj), at)

    def _replacement(self, node: str) -> Mapping[str, Any]:
        """The old Node is gone (HyperPod terminated the instance): wait for a new Ready node
        of its group created after our request; it joins under a new name."""
        seen = self._requested.get(node)
        if seen is None:
            return {
                "back": False,
                "replacement": None,
                "detail": f"{node} was removed; its replacement is not known (controller restarted)",
            }
        group, at = seen
        fresh = [
            n
            for n in self.api.list_nodes()
            if self._group(n) == group
            and _ready(n)
            and (_parse_time(n["metadata"].get("creationTimestamp")) or at) > at
            and self._info(n).schedulable
        ]
        if not fresh:
            raise NotYet(f"{node} was removed; waiting for its replacement to join {group}")
        new = _name(max(fresh, key=lambda n: str(n["metadata"].get("creationTimestamp"))))
        return {"back": False, "replacement": new, "detail": f"{node} replaced by {new}"}

    def _remediation(self) -> tuple[str, str, str]:
        mode = self.config.remediation
        if mode == "hyperpod-replace":
            return "labels", HEALTH_LABEL, PENDING_REPLACEMENT
        if mode == "hyperpod-reboot":
            return "labels", HEALTH_LABEL, PENDING_REBOOT
        where = "labels" if mode == "label" else "annotations"
        return where, self.config.remediation_key, self.config.remediation_value

    def _patch_node(
        self, node: str, change: Callable[[dict[str, Any]], tuple[dict[str, Any] | None, str]]
    ) -> Mapping[str, Any]:
        """Read, compute a patch, send it conditional on the read's resourceVersion; on 409 repeat."""
        last: KubeConflict | None = None
        for _ in range(self.config.conflict_retries):
            obj = self.node(node)
            body, detail = change(obj)
            if body is None:
                return {"detail": detail, "node": _name(obj)}
            body.setdefault("metadata", {})["resourceVersion"] = obj["metadata"]["resourceVersion"]
            try:
                self.api.patch_node(_name(obj), body)
            except KubeConflict as exc:
                last = exc
                continue
            return {"detail": detail, "node": _name(obj)}
        raise TransientBackendError(
            f"{node}: still conflicting after {self.config.conflict_retries} tries: {last}"
        )

    # --- triage and resume ------------------------------------------------------------------

    def selftest(self, node: str, key: str) -> Mapping[str, Any]:
        suspect = self.node(node)
        reference = self.config.reference_node or self._pick_reference(suspect)
        return kube_triage.run(self.api, self.config, suspect, self.node(reference), key, self._clock())

    def _pick_reference(self, suspect: dict[str, Any]) -> str:
        group, name = self._group(suspect), _name(suspect)
        for info in self.list_nodes():
            if info.schedulable and group in info.partitions and info.name != name:
                return info.name
        raise PermanentBackendError(f"no healthy node to compare {name}'s self-test with")

    def join(self, request: JoinRequest, key: str) -> Mapping[str, Any]:
        """One replacement replica group (docs/no-restart.md, "The controller's join action"):
        with ``join_mode=copy`` a copy of the departed group's Job with ``REPLICA_GROUP_ID``
        set; the cordoned node's taint keeps it off that node."""
        if self.config.join_mode == "none":
            raise JoinNotBuiltError("kubernetes (join_mode=none)", request.job_id, request.replica_group)
        from replicheck.controller.backends.kube_join import join_group

        return join_group(self.api, self.config, request, key)

    def resume(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        mode = self.config.resume_mode
        if mode == "none":
            return {"detail": "resume_mode=none: the job is not restarted by the controller"}
        if mode == "job-restart":
            kept = ", ".join(request.exclude) or "the replaced nodes"
            return {
                "detail": f"job {request.job_id} restarts by its own restart policy; the taint keeps "
                f"it off {kept}"
            }
        return kube_triage.recreate_job(self.api, self.config, request, key)

    # --- helpers ----------------------------------------------------------------------------

    def _group(self, obj: dict[str, Any]) -> str:
        label = self.config.partition_label
        return str(_meta(obj, "labels").get(label, "cluster")) if label else "cluster"

    def _info(self, obj: dict[str, Any]) -> NodeInfo:
        labels, ann, spec = _meta(obj, "labels"), _meta(obj, "annotations"), obj.get("spec") or {}
        health = labels.get(HEALTH_LABEL, "")
        ours = any(t.get("key") == self.config.taint_key for t in spec.get("taints") or [])
        schedulable = (
            _ready(obj)
            and not spec.get("unschedulable")
            and not ours
            and not health.startswith("Unschedulable")
        )
        state = ("Ready" if _ready(obj) else "NotReady") + (
            ",SchedulingDisabled" if spec.get("unschedulable") else ""
        )
        reason = ann.get(ANN_REASON, "") if ANN_ADDED in ann else health
        return NodeInfo(
            name=_name(obj),
            state=state,
            reason=reason,
            partitions=(self._group(obj),),
            schedulable=schedulable,
            extra={"health": health, "cordoned_by_us": ANN_ADDED in ann},
        )


def _uncordon_patch(obj: dict[str, Any], taint_key: str, replace_marks: bool = False) -> dict[str, Any]:
    ann = _meta(obj, "annotations")
    added = set(filter(None, ann.get(ANN_ADDED, "").split(",")))
    spec: dict[str, Any] = {}
    if "taint" in added:
        spec["taints"] = [t for t in (obj.get("spec") or {}).get("taints") or [] if t.get("key") != taint_key]
    if "unschedulable" in added:
        spec["unschedulable"] = None
    drop = CORDON_ANNOTATIONS + ((ANN_REPLACE_KEY, ANN_REPLACE_AT) if replace_marks else ())
    body: dict[str, Any] = {
        "metadata": {"labels": {LABEL_CORDONED: None}, "annotations": {a: None for a in drop}}
    }
    if spec:
        body["spec"] = spec
    return body


def _api_client(config: KubernetesConfig) -> Any:
    k8s = import_client()
    conf = k8s.client.Configuration()
    if config.host:
        conf.host = config.host
        return k8s.client.ApiClient(conf)
    try:
        if config.kubeconfig is None and config.context is None:
            try:
                k8s.config.load_incluster_config(client_configuration=conf)
                return k8s.client.ApiClient(conf)
            except k8s.config.ConfigException:
                pass
        k8s.config.load_kube_config(
            config_file=config.kubeconfig, context=config.context, client_configuration=conf
        )
    except (k8s.config.ConfigException, OSError) as exc:
        raise ConfigError(f"cannot load Kubernetes credentials: {exc}") from exc
    return k8s.client.ApiClient(conf)


def _aliases(obj: dict[str, Any]) -> set[str]:
    names = {_name(obj)}
    hostname = _meta(obj, "labels").get("kubernetes.io/hostname")
    if hostname:
        names.add(hostname)
    for addr in (obj.get("status") or {}).get("addresses") or []:
        if addr.get("type") in ("Hostname", "InternalDNS") and addr.get("address"):
            names.add(addr["address"])
            names.add(addr["address"].split(".")[0])
    return names


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def _meta(obj: Mapping[str, Any], part: str) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get(part) or {})


def _ready(obj: Mapping[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _parse_time(text: Any) -> _dt.datetime | None:
    try:
        return _dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _incident_of(key: str) -> str:
    # Keys are "<incident>:<kind>:<target>"; anything else is recorded whole.
    parts = key.rsplit(":", 2)
    return parts[0] if len(parts) == 3 else key


def _label_safe(key: str) -> str:
    """An annotation value that identifies ``key`` compactly (its hash) and readably (its start)."""
    return f"{key[:200]}#{hashlib.sha256(key.encode()).hexdigest()[:12]}"
