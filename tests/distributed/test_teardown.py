"""Process teardown after a guarded run: every rank exits with code 0 and no C++ abort."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from replicheck.harness.launch import run_processes

JOB = Path(__file__).with_name("teardown_job.py")


def _launch(tmp: Path, world: int) -> list[tuple[int, str, str]]:
    argv = [sys.executable, str(JOB), "--world", str(world), "--port-file", str(tmp / "port")]
    return run_processes(
        [[*argv, "--rank", str(r)] for r in range(world)],
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.timeout(420)
def test_guarded_job_exits_cleanly_after_destroying_the_process_group(tmp_path: Path) -> None:
    """Five launches of a 2-rank guarded job (replays, replica checks, then destroy_process_group):
    each process returns 0, finishes its work and prints no 'terminate called' abort."""
    for i in range(5):
        run_dir = tmp_path / str(i)
        run_dir.mkdir()
        for rank, (code, stdout, stderr) in enumerate(_launch(run_dir, 2)):
            assert code == 0, (i, rank, stderr[-2000:])
            assert f"rank {rank} done" in stdout
            assert "terminate called" not in stderr, (i, rank, stderr[-2000:])
