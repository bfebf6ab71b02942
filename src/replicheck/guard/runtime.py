"""Where this process runs: the one place the training side reads the environment.

The order of the sources, per launcher (documented in docs/operations.md):

* node name: ``REPLICHECK_NODE``, then Slurm's ``SLURMD_NODENAME``, then the Kubernetes
  downward-API ``NODE_NAME`` (or ``KUBERNETES_NODE_NAME``), then the host name. Under Kubernetes
  the host name is the pod's name, which no backend can cordon, hence the downward API first.
* job id: ``REPLICHECK_JOB_ID``, then ``SLURM_JOB_ID``, then torchrun's ``TORCHELASTIC_RUN_ID``
  (unless it is torchrun's placeholder ``none``), then a Kubernetes Job as ``NAMESPACE/NAME``
  from ``JOB_NAME`` (+ ``POD_NAMESPACE``, both set through the downward API), else ``local``.
* attempt: ``SLURM_RESTART_COUNT`` (a requeued job) and ``TORCHELASTIC_RESTART_COUNT`` (a
  torchrun restart), so a restarted job's incident at the same step gets a new id.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from replicheck.incident import NodeIdentity

log = logging.getLogger(__name__)

LOCAL_JOB = "local"
"""The job id when no launcher names one: incidents of two such jobs can only be told apart
by their content, which the controller does (it never merges differing copies)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """Node identity, job id and job attempt of this process, as the environment tells them."""

    node: NodeIdentity
    """This process's node in every naming scheme that is known."""
    job_id: str
    """The job id (see the module docstring for the order of sources), or ``"local"``."""
    attempt: str = ""
    """Which restart of the job this is: ``""`` for the first run, else e.g. ``"r1"`` (Slurm
    requeue 1), ``"t2"`` (torchrun restart 2) or ``"r1t2"``. Part of the incident id."""
    job_source: str = "none"
    """The variable the job id came from (``REPLICHECK_JOB_ID``, ``SLURM_JOB_ID``...)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeInfo:
        """Read the node name, job id and attempt from the launchers' variables (see above)."""
        env = os.environ if environ is None else environ
        hostname = socket.gethostname()
        slurm_node = env.get("SLURMD_NODENAME") or None
        # The Kubernetes/HyperPod convention is to expose spec.nodeName through the downward API.
        k8s_node = env.get("NODE_NAME") or env.get("KUBERNETES_NODE_NAME") or None
        name = env.get("REPLICHECK_NODE") or slurm_node or k8s_node or hostname
        node = NodeIdentity(
            name=name,
            hostname=hostname,
            slurm_node=slurm_node,
            k8s_node=k8s_node,
            instance_id=env.get("REPLICHECK_INSTANCE_ID") or env.get("INSTANCE_ID") or None,
        )
        job_id, source = _job_id(env)
        return cls(node=node, job_id=job_id, attempt=_attempt(env), job_source=source)

    @staticmethod
    def attempt_from_env(environ: Mapping[str, str] | None = None) -> str:
        """Only the attempt (read even when the job id is given explicitly)."""
        return _attempt(os.environ if environ is None else environ)


def _job_id(env: Mapping[str, str]) -> tuple[str, str]:
    for var in ("REPLICHECK_JOB_ID", "SLURM_JOB_ID"):
        if env.get(var):
            return env[var], var
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is the literal "none"
        return run_id, "TORCHELASTIC_RUN_ID"
    if env.get("JOB_NAME"):
        namespace = env.get("POD_NAMESPACE")
        return (f"{namespace}/{env['JOB_NAME']}" if namespace else env["JOB_NAME"]), "JOB_NAME"
    log.warning(
        "no job id in the environment (REPLICHECK_JOB_ID, SLURM_JOB_ID, TORCHELASTIC_RUN_ID, "
        "JOB_NAME): using %r; set REPLICHECK_JOB_ID to tell jobs apart",
        LOCAL_JOB,
    )
    return LOCAL_JOB, "none"


def _attempt(env: Mapping[str, str]) -> str:
    parts = []
    for var, tag in (("SLURM_RESTART_COUNT", "r"), ("TORCHELASTIC_RESTART_COUNT", "t")):
        raw = env.get(var, "").strip()
        if raw.isdigit() and int(raw) > 0:
            parts.append(f"{tag}{int(raw)}")
    return "".join(parts)
