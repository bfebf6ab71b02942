"""The ``kubernetes`` backend's configuration and the names it writes on nodes."""

from __future__ import annotations

from dataclasses import dataclass

from replicheck.controller.backends.base import validate_node_name
from replicheck.controller.errors import ConfigError

HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
"""HyperPod's node health label; its automatic node recovery acts on the Unschedulable* values."""
PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
PENDING_REBOOT = "UnschedulablePendingReboot"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
"""The taint the node controller adds for ``spec.unschedulable``; triage Jobs tolerate it."""

LABEL_CORDONED = "replicheck.io/cordoned"
ANN_BY = "replicheck.io/cordoned-by"
ANN_INCIDENT = "replicheck.io/incident"
ANN_AT = "replicheck.io/cordoned-at"
ANN_REASON = "replicheck.io/reason"
ANN_ADDED = "replicheck.io/cordon-added"
"""Comma-separated list of what our cordon changed: ``taint`` and/or ``unschedulable``."""
ANN_REPLACE_KEY = "replicheck.io/replace-key"
ANN_REPLACE_AT = "replicheck.io/replace-requested-at"
CORDON_ANNOTATIONS = (ANN_BY, ANN_INCIDENT, ANN_AT, ANN_REASON, ANN_ADDED)

REMEDIATIONS = ("hyperpod-replace", "hyperpod-reboot", "label", "annotation", "none")
RESUME_MODES = ("job-restart", "recreate", "none")


@dataclass(frozen=True, kw_only=True)
class KubernetesConfig:
    """How to talk to the Kubernetes API server and what to change there."""

    host: str | None = None
    """API server URL used as is, without credentials (the local fake server of the demo);
    None: in-cluster service account, else ``kubeconfig``."""
    kubeconfig: str | None = None
    """Path of a kubeconfig file (None: the client's default, ~/.kube/config)."""
    context: str | None = None
    """kubeconfig context (None: its current context)."""
    request_timeout_s: float = 30.0
    """Timeout of one API request; a timeout is a temporary error."""
    conflict_retries: int = 5
    """Re-reads after a 409 conflict before giving up with a temporary error."""
    actor: str = "replicheck-controller"
    """Written to ``replicheck.io/cordoned-by``."""
    taint_key: str = "replicheck.io/suspect"
    """Key of the NoSchedule taint our cordon adds."""
    partition_label: str | None = "sagemaker.amazonaws.com/instance-group-name"
    """Node label whose value groups nodes for the never-the-last-node rule; nodes without it
    (or None / "" here) form one group, ``cluster``."""
    remediation: str = "hyperpod-replace"
    """``hyperpod-replace`` / ``hyperpod-reboot`` (HyperPod health label), ``label`` or
    ``annotation`` (remediation_key=remediation_value for an external remediator), ``none``."""
    remediation_key: str = "replicheck.io/remediate"
    """Label or annotation key for remediation=label|annotation."""
    remediation_value: str = "replace"
    """Its value."""
    pod_lookup: bool = True
    """Map a name that is no node to the node of the pod with that name (a rank's host name is
    its pod name); needs cluster-wide ``pods list``."""
    triage_namespace: str = "replicheck"
    """Namespace of the self-test Jobs."""
    triage_image: str = "replicheck:latest"
    """Image with replicheck installed, used by the self-test Job."""
    triage_command: tuple[str, ...] = ("replicheck", "selftest", "--json", "--device", "cuda")
    """Container command; ``--node <node>`` is appended. Its last output line must be the JSON."""
    triage_gpu_resource: str | None = "nvidia.com/gpu"
    """Extended resource requested (1) by the self-test pod; None or "" requests none."""
    triage_service_account: str | None = None
    """Service account of the self-test pod (None: the namespace default)."""
    triage_timeout_s: int = 600
    """activeDeadlineSeconds of the Job; a Job without a result after this long is an error."""
    reference_node: str | None = None
    """Healthy node to compare fingerprints with (None: a schedulable node of the same group)."""
    resume_mode: str = "job-restart"
    """``job-restart``: the training job's restart policy restarts it, off the tainted node;
    ``recreate``: create a copy of the Job with the checkpoint in its env; ``none``."""
    job_namespace: str = "default"
    """Namespace of the training Job when the incident's job id is a bare name."""
    join_mode: str = "none"
    """For a job that goes on without a torchft replica group (``docs/no-restart.md``): ``copy``
    creates one copy of the departed group's Job (one Job per replica group) with
    ``REPLICA_GROUP_ID`` set (needs ``get``/``create`` on Jobs); ``none``: the incident fails for
    a person to start the group by hand."""

    def __post_init__(self) -> None:
        if self.remediation not in REMEDIATIONS:
            raise ConfigError(
                f"remediation must be one of {', '.join(REMEDIATIONS)}, got {self.remediation!r}"
            )
        if self.resume_mode not in RESUME_MODES:
            raise ConfigError(
                f"resume_mode must be one of {', '.join(RESUME_MODES)}, got {self.resume_mode!r}"
            )
        if self.join_mode not in ("copy", "none"):
            raise ConfigError(f"join_mode must be copy or none, got {self.join_mode!r}")
        if self.conflict_retries < 1:
            raise ConfigError("conflict_retries must be >= 1")
        if not self.taint_key or "=" in self.taint_key:
            raise ConfigError(f"taint_key must be a plain key, got {self.taint_key!r}")
        if self.remediation in ("label", "annotation") and not self.remediation_key:
            raise ConfigError("remediation=label|annotation needs remediation_key")
        if not self.triage_command:
            raise ConfigError("triage_command must not be empty")
        if self.reference_node is not None:
            validate_node_name(self.reference_node)
