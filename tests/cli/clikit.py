"""Running the installed ``replicheck`` entry point (the console script pip made) as a user does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def entry_point() -> str:
    """The console script next to this interpreter (``.venv/bin/replicheck``), else on PATH."""
    here = Path(sys.executable).parent / "replicheck"
    found = str(here) if here.exists() else shutil.which("replicheck")
    if found is None:
        raise RuntimeError("the replicheck entry point is not installed (pip install -e .)")
    return found


def replicheck(
    *args: str, cwd: str | Path | None = None, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "REPLICHECK_DB"}
    return subprocess.run(
        [entry_point(), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
