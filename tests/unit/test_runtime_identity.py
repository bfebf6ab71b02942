"""Job identity, node name sources and incident files (issue 12 items 2-4)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))  # ctlkit: incidents for tests
from ctlkit import make_incident  # noqa: E402

from replicheck.guard.runtime import RuntimeInfo
from replicheck.incident import make_incident_id, read_incident, write_incident

SLURM = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "gpu-07", "SLURM_RESTART_COUNT": "0"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "llm-pretrain", "TORCHELASTIC_RESTART_COUNT": "0"}
K8S = {"JOB_NAME": "llm", "POD_NAMESPACE": "ml", "NODE_NAME": "ip-10-0-0-7"}


@pytest.mark.parametrize(
    ("env", "job", "source"),
    [
        ({}, "local", "none"),
        (SLURM, "4242", "SLURM_JOB_ID"),
        (TORCHRUN, "llm-pretrain", "TORCHELASTIC_RUN_ID"),
        ({"TORCHELASTIC_RUN_ID": "none"}, "local", "none"),
        (K8S, "ml/llm", "JOB_NAME"),
        ({"JOB_NAME": "llm"}, "llm", "JOB_NAME"),
        ({**SLURM, **TORCHRUN}, "4242", "SLURM_JOB_ID"),
        ({**K8S, **TORCHRUN}, "llm-pretrain", "TORCHELASTIC_RUN_ID"),
        ({**SLURM, **TORCHRUN, **K8S, "REPLICHECK_JOB_ID": "mine"}, "mine", "REPLICHECK_JOB_ID"),
    ],
)
def test_job_id_sources_in_order(env: dict[str, str], job: str, source: str) -> None:
    """The job id is REPLICHECK_JOB_ID, then SLURM_JOB_ID, then TORCHELASTIC_RUN_ID (not 'none'),
    then NAMESPACE/JOB_NAME, else 'local'."""
    info = RuntimeInfo.from_env(env)
    assert (info.job_id, info.job_source) == (job, source)


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, None),
        ({"NODE_NAME": "k8s-node"}, "k8s-node"),
        ({"KUBERNETES_NODE_NAME": "k8s-node"}, "k8s-node"),
        ({"NODE_NAME": "k8s-node", "SLURMD_NODENAME": "gpu-07"}, "gpu-07"),
        ({"NODE_NAME": "k8s-node", "SLURMD_NODENAME": "gpu-07", "REPLICHECK_NODE": "mine"}, "mine"),
    ],
)
def test_node_name_sources_in_order(env: dict[str, str], name: str | None) -> None:
    """The node name is REPLICHECK_NODE, then SLURMD_NODENAME, then NODE_NAME (Kubernetes
    downward API) / KUBERNETES_NODE_NAME, then the host name."""
    import socket

    info = RuntimeInfo.from_env(env)
    assert info.node.name == (name or socket.gethostname())
    assert info.node.k8s_node == (env.get("NODE_NAME") or env.get("KUBERNETES_NODE_NAME"))


def test_restarts_get_distinct_incident_ids() -> None:
    """A requeued Slurm job or a restarted torchrun job computes a new incident id at the same step."""
    ids = set()
    for env in (
        SLURM,
        {**SLURM, "SLURM_RESTART_COUNT": "1"},
        {**SLURM, "TORCHELASTIC_RESTART_COUNT": "2"},
        {**SLURM, "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2"},
    ):
        info = RuntimeInfo.from_env(env)
        ids.add(make_incident_id(info.job_id, 40, "replay", info.attempt))
    assert ids == {"4242-s40-replay", "4242-r1-s40-replay", "4242-t2-s40-replay", "4242-r1t2-s40-replay"}


def test_incident_files_are_never_overwritten(tmp_path: Path) -> None:
    """A second, different incident with the same id goes to NAME.1.json; the same one again
    returns the existing file; neither is lost."""
    first, second = make_incident(nodes=("n2",)), make_incident(nodes=("n3",))
    assert first.id == second.id
    a = write_incident(first, tmp_path)
    b = write_incident(second, tmp_path)
    again = write_incident(first, tmp_path)
    assert (a.name, b.name, again) == (f"{first.id}.json", f"{first.id}.1.json", a)
    assert read_incident(a) == first and read_incident(b) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])


def test_incident_file_mode_is_deliberate(tmp_path: Path) -> None:
    """Incident files are 0640 by default whatever the umask, and take the mode asked for."""
    old = os.umask(0o077)
    try:
        default = write_incident(make_incident(step=1), tmp_path)
        private = write_incident(make_incident(step=2), tmp_path, mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(default.stat().st_mode) == 0o640
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="permission bits"):
        write_incident(make_incident(step=3), tmp_path, mode=0o4755)
