"""torchrun (2 processes, c10d rendezvous on a free port): the incident reaches the agent's error
summary, `replicheck launch` ends the job with 87, and a restart on the suspect node is refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from clikit import entry_point

JOB = Path(__file__).with_name("torchrun_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(tmp_path: Path, *extra: str, launch: bool) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{_free_port()}",
        "--rdzv-id",
        "job-77",
        *extra,
        str(JOB),
        "--incident-dir",
        str(tmp_path / "incidents"),
        "--out",
        str(out),
        "--fault-rank",
        "1",
    ]
    if launch:
        cmd = [entry_point(), "launch", "--incident-dir", str(tmp_path / "incidents"), "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("REPLICHECK_JOB_ID", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.timeout(300)
def test_incident_reaches_torchrun_summary_and_job_ends_87(tmp_path: Path) -> None:
    """A detection under torchrun: the agent's failure summary shows exit code 87 and the
    incident (id, suspect node); wrapped in `replicheck launch` the whole job exits 87."""
    run = _torchrun(tmp_path, "--max-restarts", "0", launch=True)
    assert run.returncode == 87, run.stderr[-4000:]
    text = run.stdout + run.stderr
    summary = text[text.index("Root Cause (first observed failure)") :]
    assert "exitcode  : 87" in summary, text[-4000:]
    assert "SILENT DATA CORRUPTION detected at step 3" in summary
    assert "job-77-s3-gradients" in summary and "rank 1 on gpu-node-1" in summary
    files = sorted(p.name for p in (tmp_path / "incidents").iterdir())
    assert files == ["job-77-s3-gradients.json"]
    assert oct((tmp_path / "incidents" / files[0]).stat().st_mode & 0o777) == "0o640"


@pytest.mark.timeout(300)
def test_restart_on_the_suspect_node_is_refused(tmp_path: Path) -> None:
    """With --max-restarts 1 the restarted workers on the suspect node refuse to train (exit 86,
    named in the summary); only the first attempt ever started training."""
    run = _torchrun(tmp_path, "--max-restarts", "1", launch=False)
    text = run.stdout + run.stderr
    assert run.returncode != 0
    summary = text[text.index("torchrun_job.py FAILED") :]  # failures and root cause, any order
    assert "exitcode  : 86" in summary and "refusing to run on gpu-node-1" in summary, text[-4000:]
    assert "job-77-s3-gradients" in summary
    started = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert started == ["started-0-0", "started-0-1"]
    refused = subprocess.run(
        [entry_point(), "launch", "--incident-dir", str(tmp_path / "incidents"), "--node", "gpu-node-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 86 and "job-77-s3-gradients" in refused.stderr
    fine = subprocess.run(
        [entry_point(), "launch", "--incident-dir", str(tmp_path / "incidents"), "--node", "gpu-node-0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fine.returncode == 0, fine.stderr
