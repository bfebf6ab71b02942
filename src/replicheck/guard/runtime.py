"""Where this process runs: the one place the training side reads the environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from replicheck.incident import NodeIdentity


@dataclass(frozen=True)
class RuntimeInfo:
    """Node identity and job id of this process, as the environment tells them."""

    node: NodeIdentity
    """This process's node in every naming scheme that is known."""
    job_id: str
    """The job id (Slurm job id, or REPLICHECK_JOB_ID, or ``"local"``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeInfo:
        """Read REPLICHECK_NODE, SLURMD_NODENAME, NODE_NAME, INSTANCE_ID and job ids."""
        env = os.environ if environ is None else environ
        hostname = socket.gethostname()
        slurm_node = env.get("SLURMD_NODENAME") or None
        name = env.get("REPLICHECK_NODE") or slurm_node or hostname
        node = NodeIdentity(
            name=name,
            hostname=hostname,
            slurm_node=slurm_node,
            # The HyperPod/EKS convention is to expose spec.nodeName through the downward API.
            k8s_node=env.get("NODE_NAME") or env.get("KUBERNETES_NODE_NAME") or None,
            instance_id=env.get("REPLICHECK_INSTANCE_ID") or env.get("INSTANCE_ID") or None,
        )
        job_id = env.get("REPLICHECK_JOB_ID") or env.get("SLURM_JOB_ID") or "local"
        return cls(node=node, job_id=job_id)
