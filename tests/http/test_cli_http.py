"""`replicheck controller run --http` and `replicheck controller serve` as processes: the URL is
printed, jobs post, the running controller acts on an approval at once, signals stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from httpkit import ALICE_TOKEN, call, cluster, make_incident, write_tokens

from replicheck.incident_post import PostConfig, post_incident, read_token

pytestmark = pytest.mark.timeout(180)

SRC = Path(__file__).resolve().parents[2] / "src"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **extra}
    for key in ("REPLICHECK_DB", "REPLICHECK_JOB_TOKEN_FILE", "REPLICHECK_OPERATOR_TOKEN_FILE"):
        if key not in extra:
            env.pop(key, None)
    return env


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicheck", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"approval page: (http://\S+)/ ", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("no URL printed:\n" + "".join(seen))


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, Path]:
    return write_tokens(tmp_path)


def _wait_state(url: str, iid: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        reply = call(url, "GET", f"/api/v1/incidents/{iid}", token=ALICE_TOKEN)
        last = reply.json()["record"]["state"] if reply.status == 200 else reply.status
        if last == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"{iid} is {last}, not {state}")


def test_controller_run_with_http(tmp_path: Path, tokens: tuple[Path, Path]) -> None:
    """A job posts to `controller run --http`; the controller cordons; an approval over HTTP is
    acted on without waiting for the next poll; SIGTERM stops the process cleanly."""
    db = tmp_path / "c.db"
    cluster(db)
    job, operator = tokens
    proc, url = _start(
        [
            "controller",
            "run",
            "--db",
            str(db),
            "--apply",
            "--checkpoint-root",
            "/ckpt",  # the incident's checkpoint is /ckpt/step-30
            "--http",
            "127.0.0.1:0",
            "--interval",
            "60",
        ],
        _env(REPLICHECK_JOB_TOKEN_FILE=str(job), REPLICHECK_OPERATOR_TOKEN_FILE=str(operator)),
    )
    try:
        inc = make_incident()
        assert post_incident(inc, PostConfig(url=url, token=read_token(job))).delivered
        _wait_state(url, inc.id, "awaiting_approval")
        assert call(url, "POST", f"/api/v1/incidents/{inc.id}/approve", token=ALICE_TOKEN).status == 200
        _wait_state(url, inc.id, "resumed", timeout=20)  # far less than the 60 s poll interval
    finally:
        assert _stop(proc) == 0


def test_controller_serve(tmp_path: Path, tokens: tuple[Path, Path]) -> None:
    """`controller serve` serves an existing database (page, API, metrics) and refuses a missing
    one or a missing operator token with a one-line error."""
    db = tmp_path / "c.db"
    cluster(db)
    job, operator = tokens
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicheck",
            "controller",
            "serve",
            "--db",
            str(tmp_path / "none.db"),
            "--operator-token-file",
            str(operator),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert missing.returncode == 2 and "no controller database" in missing.stderr
    no_token = subprocess.run(
        [sys.executable, "-m", "replicheck", "controller", "serve", "--db", str(db), "--http", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert no_token.returncode == 2 and "--operator-token-file" in no_token.stderr
    proc, url = _start(
        [
            "controller",
            "serve",
            "--db",
            str(db),
            "--http",
            "127.0.0.1:0",
            "--operator-token-file",
            str(operator),
        ],
        _env(),
    )
    try:
        assert call(url, "GET", "/").status == 200
        assert call(url, "GET", "/api/v1/incidents", token=ALICE_TOKEN).json()["incidents"] == []
        assert b"replicheck_incidents" in call(url, "GET", "/metrics").body
    finally:
        assert _stop(proc) == 0


def test_http_package_never_imports_torch(tmp_path: Path, tokens: tuple[Path, Path]) -> None:
    """Building the app (API, page, metrics) and the poster import no torch."""
    job, operator = tokens
    code = (
        "import sys\n"
        "from replicheck.controller.http import HttpConfig, Role, create_app, read_token_file\n"
        "import replicheck.controller.http.metrics, replicheck.incident_post\n"
        "tokens = read_token_file(sys.argv[2], Role.OPERATOR) + read_token_file(sys.argv[3], Role.JOB)\n"
        "create_app(HttpConfig(db_path=sys.argv[1], tokens=tokens)).app.openapi()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('clean')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.db"), str(operator), str(job)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "clean"
