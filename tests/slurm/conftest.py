"""The real Slurm cluster fixture. Skips (with the reason) only outside CI when it cannot run;
with CI=true a missing prerequisite is a failure."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurmkit import SlurmCluster, missing_binaries


def _unavailable(accounting: bool) -> str | None:
    missing = missing_binaries(accounting)
    if missing:
        return f"Slurm binaries missing ({', '.join(missing)}); run `make system-deps` as root"
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd runs jobs as any user)"
    return None


def _require_slurm(accounting: bool) -> None:
    """Skip only outside CI when not root; anywhere else a cluster that cannot start fails."""
    reason = _unavailable(accounting)
    if reason is None:
        return
    if os.environ.get("CI") != "true" and os.geteuid() != 0:
        pytest.skip(reason)
    pytest.fail(f"the Slurm tests cannot run: {reason}")


def _running_cluster(nodes: int, accounting: bool = False) -> Iterator[SlurmCluster]:
    """Start a cluster of ``nodes`` (skipping outside CI if Slurm cannot run), stop it after."""
    _require_slurm(accounting)
    cluster = SlurmCluster(_short_tmp(), nodes=nodes, accounting=accounting)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def _short_tmp() -> Path:
    # Unix socket paths are limited to 108 bytes; pytest's tmp paths can be longer.
    return Path(tempfile.mkdtemp(prefix="rc-slurm-", dir="/tmp"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A 4-node cluster (node1..node4 in partition debug) with job accounting (slurmdbd on a
    private MariaDB), for the whole session."""
    yield from _running_cluster(nodes=4, accounting=True)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The session cluster with every node idle again."""
    slurm_cluster.reset_nodes()
    return slurm_cluster


@pytest.fixture
def private_slurm() -> Iterator[SlurmCluster]:
    """A cluster of its own, for tests that stop its slurmctld."""
    yield from _running_cluster(nodes=2)
