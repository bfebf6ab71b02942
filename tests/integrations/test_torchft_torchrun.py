"""``examples/torchft_ddp.py`` as a user runs it: the ``torchft_lighthouse`` binary from the
torchft wheel, and one ``torchrun --nproc-per-node 2`` per replica group (3 groups), DDP inside
each group, bf16 autocast and clipping in the guard. A fault on rank 1 of group 1 from step 6 is
caught at step 6; group 1's torchrun ends with its workers' 87; groups 0 and 2 take step 6 again
with 2 groups and finish."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replicheck.incident import Continuation, read_incident

EXAMPLE = Path(__file__).parents[2] / "examples" / "torchft_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lighthouse_binary() -> str:
    here = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(here) if here.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise AssertionError("torchft_lighthouse is not installed (pip install 'replicheck[torchft]')")
    return found


@pytest.mark.timeout(180)
def test_three_torchrun_groups_one_leaves_the_others_finish(tmp_path: Path) -> None:
    """What a person running the example sees: groups 0 and 2 print that step 6 was voted down
    with group1 named (persistent), then step 6 committed by 2 groups, and end at step 12 with
    exit 0; group 1's torchrun fails with a worker's exit code 87 and the summary saying the other
    groups go on; one incident file with continuation no_restart for group1."""
    port = _free_port()
    lighthouse = subprocess.Popen(
        [
            _lighthouse_binary(),
            "--min_replicas", "2", "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1000",
            "--bind", f"[::]:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    incidents = tmp_path / "incidents"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    groups = []
    try:
        for g in range(3):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port()), str(EXAMPLE), "--group", str(g),
                "--lighthouse", f"http://localhost:{port}", "--steps", "12",
                "--incident-dir", str(incidents), "--fault", "1:1:6",
            ]  # fmt: skip
            log = (tmp_path / f"g{g}.log").open("w")
            groups.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.monotonic() + 150
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p, _ in groups]
    finally:
        for p, log in groups:
            if p.poll() is None:
                p.kill()
                p.wait(5)
            log.close()
        lighthouse.kill()
        lighthouse.wait(5)
    out = [(tmp_path / f"g{g}.log").read_text() for g in range(3)]
    assert codes == [0, 1, 0], "\n\n".join(o[-3000:] for o in out)
    for g in (0, 2):
        assert f"group {g}: step 6 voted down: group1 named (persistent); taking step 6 again" in out[g]
        assert f"group {g}: step 6 committed by 2 groups" in out[g]
        assert f"group {g}: step 11 committed by 2 groups" in out[g]
        assert f"group {g}: done at step 12" in out[g]
    assert "exitcode  : 87" in out[1]
    assert "replica group group1 exits with code 87 and the other groups go on without it" in out[1]
    (written,) = incidents.glob("*.json")
    incident = read_incident(written)
    assert (incident.step, incident.classification) == (6, "persistent")
    assert incident.continuation == Continuation(mode="no_restart", replica_group="group1")
