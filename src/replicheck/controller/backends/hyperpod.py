"""``hyperpod``: replace or reboot nodes through the SageMaker HyperPod API (boto3).

For clusters without EKS automatic node recovery, and for Slurm-orchestrated HyperPod when
the operator prefers the API to ``Action:Replace``. The incident's node name (host name,
private DNS name, ``hyperpod-i-...`` Kubernetes name or instance id) is mapped to its instance
through ``ListClusterNodes``; ``BatchReplaceClusterNodes`` / ``BatchRebootClusterNodes`` act
on it (at most 25 ids per call) and ``DescribeClusterNode`` is polled until it is back or a
new instance took its place. Cordon, triage and resume go to an orchestrator backend
(slurm or kubernetes) when one is configured.

Idempotency: before calling, the node's instance status is read; an instance that is not
``Running`` already has a replacement or reboot under way, and an ``InstanceIdInUse`` answer
says the same, so a controller killed after the request and restarted sends no second one.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replicheck.controller.backends.base import (
    Backend,
    JoinRequest,
    NodeInfo,
    ResumeRequest,
    validate_node_name,
)
from replicheck.controller.backends.extras import missing_extra
from replicheck.controller.errors import (
    ConfigError,
    JoinNotBuiltError,
    NotYet,
    PermanentBackendError,
    TransientBackendError,
)

EXTRA = "hyperpod"
BATCH_LIMIT = 25
"""Most node ids one BatchReplaceClusterNodes / BatchRebootClusterNodes call takes."""
ACTIONS = ("replace", "reboot")
ORCHESTRATORS = ("none", "slurm", "kubernetes")
_TRANSIENT_CODES = {
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "ServiceUnavailable",
    "InternalFailure",
    "InternalServerError",
    "RequestTimeout",
    "RequestTimeoutException",
    "ProvisionedThroughputExceededException",
}
_BUSY = frozenset(
    {
        "Pending",
        "ShuttingDown",
        "SystemUpdating",
        "DeepHealthCheckInProgress",
        "DetachInProgress",
        "AttachInProgress",
    }
)
"""Instance statuses that mean a replacement or reboot (or another operation) is under way."""


@dataclass(frozen=True, kw_only=True)
class HyperPodConfig:
    """Which HyperPod cluster, and what to ask of it."""

    cluster_name: str | None = None
    """Cluster name or ARN (required)."""
    region: str | None = None
    """AWS region (None: the boto3 default chain)."""
    profile: str | None = None
    """AWS profile name (None: the default credentials chain, e.g. the pod's IAM role)."""
    action: str = "replace"
    """``replace`` (BatchReplaceClusterNodes: new hardware) or ``reboot`` (BatchRebootClusterNodes)."""
    orchestrator: str = "none"
    """Backend that cordons, triages and resumes: ``slurm``, ``kubernetes`` or ``none`` (then
    cordon is a recorded no-op, triage is unavailable and resume is left to the job)."""
    max_attempts: int = 5
    """botocore retry attempts (standard mode) within one call; throttling beyond that is a
    temporary error the controller retries later."""
    reboot_settle_s: float = 60.0
    """After a reboot request, a node seen ``Running`` counts as back only once it was seen in
    another state or this long has passed (the status may lag the request)."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"action must be replace or reboot, got {self.action!r}")
        if self.orchestrator not in ORCHESTRATORS:
            raise ConfigError(
                f"orchestrator must be one of {', '.join(ORCHESTRATORS)}, got {self.orchestrator!r}"
            )
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be >= 1")


class NoSuchInstance(PermanentBackendError):
    """No instance of the cluster has the given node name."""


@dataclass
class _Request:
    instance_id: str
    group: str
    at: _dt.datetime | None
    seen_busy: bool = False


class HyperPodBackend:
    """The Backend protocol on the SageMaker HyperPod API."""

    name = "hyperpod"

    def __init__(
        self,
        config: HyperPodConfig,
        client: Any = None,
        orchestrator: Backend | None = None,
        clock: Callable[[], _dt.datetime] | None = None,
    ) -> None:
        """``client``: a boto3 ``sagemaker`` client (default: built from ``config``)."""
        if not config.cluster_name:
            raise ConfigError("the hyperpod backend needs cluster_name ([hyperpod] cluster_name = ...)")
        self.config = config
        self.cluster = config.cluster_name
        self._client = client if client is not None else _make_client(config)
        self._orchestrator = orchestrator
        self._clock = clock or (lambda: _dt.datetime.now(_dt.UTC))
        self._requests: dict[str, _Request] = {}

    # --- observation ------------------------------------------------------------------------

    def cluster_nodes(
        self, group: str | None = None, after: _dt.datetime | None = None
    ) -> list[dict[str, Any]]:
        """Every node summary of the cluster (all pages), optionally of one group / launched after."""
        args: dict[str, Any] = {"ClusterName": self.cluster}
        if group:
            args["InstanceGroupNameContains"] = group
        if after is not None:
            args["CreationTimeAfter"] = after
        out: list[dict[str, Any]] = []
        pages = self._client.get_paginator("list_cluster_nodes").paginate(**args)
        for page in _guard("ListClusterNodes", lambda: list(pages)):
            out.extend(page.get("ClusterNodeSummaries") or [])
        return out

    def instance(self, node: str) -> dict[str, Any]:
        """The node summary an incident's node name refers to."""
        validate_node_name(node)
        matches = [s for s in self.cluster_nodes() if node in _aliases(s)]
        if not matches:
            raise NoSuchInstance(f"no instance of HyperPod cluster {self.cluster} matches {node!r}")
        if len(matches) > 1:
            raise PermanentBackendError(
                f"{node!r} matches several instances: {', '.join(sorted(s['InstanceId'] for s in matches))}"
            )
        return matches[0]

    def list_nodes(self) -> list[NodeInfo]:
        if self._orchestrator is not None:
            return self._orchestrator.list_nodes()
        return sorted((_info(s) for s in self.cluster_nodes()), key=lambda i: i.name)

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The job's nodes as the orchestrator (Slurm or Kubernetes) reports them; HyperPod itself
        knows no jobs, so with ``orchestrator = "none"`` no job can be verified (None)."""
        if self._orchestrator is not None:
            return self._orchestrator.allocation(job_id)
        return None

    def schedulable_by_partition(self, node: str) -> Mapping[str, Sequence[str]]:
        if self._orchestrator is not None:
            return self._orchestrator.schedulable_by_partition(node)
        mine = self.instance(node)
        group, iid = mine["InstanceGroupName"], mine["InstanceId"]
        # The node under the caller's name (it may be an alias), so the last-node rule sees it.
        return {
            group: [
                node if i.extra.get("instance_id") == iid else i.name
                for i in self.list_nodes()
                if group in i.partitions and i.schedulable
            ]
        }

    # --- delegated to the orchestrator ------------------------------------------------------

    def cordon(self, node: str, reason: str, key: str) -> Mapping[str, Any]:
        if self._orchestrator is not None:
            return self._orchestrator.cordon(node, reason, key)
        self.instance(node)
        return {"detail": f"orchestrator=none: nothing cordons {node}; it is replaced on approval"}

    def uncordon(self, node: str, reason_prefix: str, key: str) -> Mapping[str, Any]:
        if self._orchestrator is not None:
            return self._orchestrator.uncordon(node, reason_prefix, key)
        return {"detail": f"orchestrator=none: {node} was never cordoned"}

    def selftest(self, node: str, key: str) -> Mapping[str, Any]:
        if self._orchestrator is not None:
            return self._orchestrator.selftest(node, key)
        raise PermanentBackendError(
            "orchestrator=none cannot run the self-test: set [hyperpod] orchestrator "
            "or [controller] triage = false"
        )

    def resume(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        if self._orchestrator is not None:
            return self._orchestrator.resume(request, key)
        return {"detail": "orchestrator=none: the job restarts by its own means"}

    def join(self, request: JoinRequest, key: str) -> Mapping[str, Any]:
        # The replacement group is started by the orchestrator (Slurm or Kubernetes); HyperPod
        # only swaps the instance.
        if self._orchestrator is not None:
            return self._orchestrator.join(request, key)
        raise JoinNotBuiltError("hyperpod (orchestrator=none)", request.job_id, request.replica_group)

    # --- replacement ------------------------------------------------------------------------

    def replace(self, node: str, key: str) -> Mapping[str, Any]:
        verb = self.config.action
        try:
            summary = self.instance(node)
        except NoSuchInstance as exc:
            # Replaced nodes are terminated: after a crash the old instance may be gone already.
            return {"detail": f"{node}: no such instance any more (already replaced?): {exc}"}
        iid, group = summary["InstanceId"], summary["InstanceGroupName"]
        status = summary["InstanceStatus"]["Status"]
        if status in _BUSY:
            # Requested before (by us before a restart, or by someone else): when is unknown.
            self._requests.setdefault(node, _Request(iid, group, None))
            return {
                "detail": f"{node} ({iid}) is {status}: a {verb} is already under way",
                "instance_id": iid,
            }
        # Remembered per node (await_return has its own key); the time bounds the replacement's launch.
        self._requests[node] = _Request(iid, group, self._clock())
        failed = self.request([iid])
        if iid in failed:
            code, message = failed[iid]
            if code == "InstanceIdInUse":
                return {"detail": f"{node} ({iid}): {verb} already under way ({message})", "instance_id": iid}
            error = (
                TransientBackendError
                if code in ("InternalServerError", "InvalidInstanceStatus")
                else PermanentBackendError
            )
            self._requests.pop(node, None)
            raise error(f"{verb} {node} ({iid}) failed: {code}: {message}")
        return {"detail": f"{verb} of {node} ({iid}) requested", "instance_id": iid}

    def request(self, instance_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """Replace or reboot ``instance_ids`` in calls of at most 25; returns the failed ones
        as ``{id: (error code, message)}``."""
        operation = (
            "batch_replace_cluster_nodes" if self.config.action == "replace" else "batch_reboot_cluster_nodes"
        )
        call = getattr(self._client, operation)
        failed: dict[str, tuple[str, str]] = {}
        ids = list(dict.fromkeys(instance_ids))
        for start in range(0, len(ids), BATCH_LIMIT):
            chunk = ids[start : start + BATCH_LIMIT]
            answer = _guard(operation, lambda chunk=chunk: call(ClusterName=self.cluster, NodeIds=chunk))
            for entry in answer.get("Failed") or []:
                failed[entry["NodeId"]] = (entry["ErrorCode"], entry.get("Message", ""))
        return failed

    def await_return(self, node: str, key: str) -> Mapping[str, Any]:
        req = self._requests.get(node)
        if req is None:
            try:
                summary = self.instance(node)
            except NoSuchInstance:
                return {
                    "back": False,
                    "replacement": None,
                    "detail": f"{node}'s instance is gone; its replacement is not known after a restart",
                }
            req = self._requests[node] = _Request(summary["InstanceId"], summary["InstanceGroupName"], None)
        details = self._describe(req.instance_id)
        if details is None:
            return self._replacement(node, req)
        status = details.get("InstanceStatus", {}).get("Status", "Unknown")
        if status == "Failure":
            message = details.get("InstanceStatus", {}).get("Message", "")
            return {"back": False, "replacement": None, "detail": f"{req.instance_id} failed: {message}"}
        if status != "Running" or self.config.action == "replace":
            # A replaced instance is terminated; while it still exists the new one is not ready.
            req.seen_busy |= status != "Running"
            raise NotYet(f"{node} ({req.instance_id}) is {status}")
        settled = req.at is None or (self._clock() - req.at).total_seconds() >= self.config.reboot_settle_s
        if not (req.seen_busy or settled):
            raise NotYet(f"{node} ({req.instance_id}) still Running: reboot not started yet")
        return {"back": True, "replacement": None, "detail": f"{node} ({req.instance_id}) is Running again"}

    def _describe(self, instance_id: str) -> dict[str, Any] | None:
        try:
            answer = _guard(
                "DescribeClusterNode",
                lambda: self._client.describe_cluster_node(ClusterName=self.cluster, NodeId=instance_id),
                not_found_ok=True,
            )
        except _Gone:
            return None
        return dict(answer.get("NodeDetails") or {})

    def _replacement(self, node: str, req: _Request) -> Mapping[str, Any]:
        if req.at is None:
            return {
                "back": False,
                "replacement": None,
                "detail": f"{req.instance_id} is gone; its replacement is not known after a restart",
            }
        fresh = [
            s
            for s in self.cluster_nodes(req.group, after=req.at - _dt.timedelta(seconds=1))
            if s["InstanceId"] != req.instance_id and s["InstanceGroupName"] == req.group
        ]
        running = [s for s in fresh if s["InstanceStatus"]["Status"] == "Running"]
        if not running:
            raise NotYet(f"{req.instance_id} is gone; its replacement in {req.group} is not Running yet")
        new = sorted(running, key=lambda s: str(s.get("LaunchTime")))[-1]
        name = _display_name(new)
        return {
            "back": False,
            "replacement": name,
            "instance_id": new["InstanceId"],
            "detail": f"{node} ({req.instance_id}) replaced by {name} ({new['InstanceId']})",
        }


class _Gone(Exception):
    pass


def _guard(operation: str, fn: Any, not_found_ok: bool = False) -> Any:
    """Call ``fn``; botocore errors become temporary or permanent backend errors by code."""
    from botocore.exceptions import (  # type: ignore[import-untyped, unused-ignore]
        BotoCoreError,
        ClientError,
        ConnectionError,
        HTTPClientError,
        ParamValidationError,
    )

    try:
        return fn()
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        message = str(exc.response.get("Error", {}).get("Message", exc))
        if code == "ResourceNotFound" and not_found_ok:
            raise _Gone() from exc
        if (
            code in _TRANSIENT_CODES
            or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
        ):
            raise TransientBackendError(f"{operation}: {code}: {message}") from exc
        raise PermanentBackendError(f"{operation}: {code}: {message}") from exc
    except ParamValidationError as exc:
        raise PermanentBackendError(f"{operation}: invalid request: {exc}") from exc
    except (ConnectionError, HTTPClientError) as exc:
        raise TransientBackendError(f"{operation}: {exc}") from exc
    except BotoCoreError as exc:
        raise PermanentBackendError(f"{operation}: {exc}") from exc


def _make_client(config: HyperPodConfig) -> Any:
    try:
        import boto3  # type: ignore[import-untyped, unused-ignore]
        from botocore.config import Config  # type: ignore[import-untyped, unused-ignore]
    except ImportError as exc:
        raise missing_extra("hyperpod backend", "boto3", EXTRA) from exc
    session = boto3.session.Session(profile_name=config.profile, region_name=config.region)
    return session.client(
        "sagemaker", config=Config(retries={"max_attempts": config.max_attempts, "mode": "standard"})
    )


def _aliases(summary: Mapping[str, Any]) -> set[str]:
    iid = str(summary["InstanceId"])
    names = {iid, f"hyperpod-{iid}"}
    dns = summary.get("PrivateDnsHostname")
    if dns:
        names |= {str(dns), str(dns).split(".")[0]}
    return names


def _display_name(summary: Mapping[str, Any]) -> str:
    dns = summary.get("PrivateDnsHostname")
    return str(dns).split(".")[0] if dns else str(summary["InstanceId"])


def _info(summary: Mapping[str, Any]) -> NodeInfo:
    status = summary["InstanceStatus"]["Status"]
    return NodeInfo(
        name=_display_name(summary),
        state=status,
        reason=str(summary["InstanceStatus"].get("Message", "")),
        partitions=(str(summary["InstanceGroupName"]),),
        schedulable=status == "Running",
        extra={"instance_id": summary["InstanceId"], "instance_type": summary.get("InstanceType")},
    )


__all__ = ["BATCH_LIMIT", "HyperPodBackend", "HyperPodConfig"]
