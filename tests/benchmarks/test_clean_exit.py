"""Process teardown with a guard in place is clean (issue 11: one run of an overhead harness
ended with rank 0 aborting at exit, "terminate called without an active exception").

The ranks run as plain subprocesses (not through the harness, which ignores a rank's exit status
once its result has arrived), so an abort at interpreter exit shows as a non-zero status here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from replicheck.harness.launch import run_processes

JOB = Path(__file__).with_name("exit_job.py")


def _job(world: int, scenario: str) -> list[tuple[int, str, str]]:
    # The test hosts the rendezvous store on a free port, as the harness does.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    argvs = [[sys.executable, str(JOB), str(r), str(world), str(store.port), scenario] for r in range(world)]
    try:
        return run_processes(argvs, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        del store


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", ["destroy", "no_destroy", "fault"])
def test_ranks_exit_cleanly_after_guarded_steps(scenario: str) -> None:
    """After verified steps (or a detection on every rank), with or without
    destroy_process_group(), every rank exits with status 0 and no abort message."""
    world = 3 if scenario == "fault" else 2
    for rc, stdout, stderr in _job(world, scenario):
        assert rc == 0, stderr[-3000:]
        assert "terminate called" not in stderr
        assert "finished" in stdout
        if scenario == "fault":
            assert "incident at 4" in stdout
        else:
            assert "incident at None" in stdout
