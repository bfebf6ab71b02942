"""Cluster backends: ``local`` (simulated, in SQLite) and ``slurm`` (scontrol/sbatch)."""

from replicheck.controller.backends.base import (
    Backend,
    NodeInfo,
    ResumeRequest,
    validate_node_name,
)
from replicheck.controller.backends.local import LocalBackend, ResumeRecord

__all__ = ["Backend", "LocalBackend", "NodeInfo", "ResumeRecord", "ResumeRequest", "validate_node_name"]
