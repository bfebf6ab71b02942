"""The training side's incident poster (stdlib only): delivery to the real API, retries with
backoff, and the local fallback file when the controller is down or refuses the record."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from httpkit import JOB_TOKEN, Live, make_incident

from replicheck.incident import read_incident
from replicheck.incident_post import PostConfig, PostConfigError, post_incident, read_token

pytestmark = pytest.mark.timeout(120)


def test_delivered_to_the_controller(live: Live, tmp_path: Path) -> None:
    """Posted with the job token, the incident is stored; no fallback file is written."""
    inc = make_incident()
    result = post_incident(
        inc,
        PostConfig(
            url=live.url, token=read_token(live.job_token_file), fallback_dir=str(tmp_path / "fallback")
        ),
    )
    assert result.delivered and result.status == 201 and result.attempts == 1
    assert not (tmp_path / "fallback").exists()
    with live.controller() as ctl:
        assert ctl.store.get_incident(inc.id).incident == inc
    again = post_incident(inc, PostConfig(url=live.url, token=JOB_TOKEN))
    assert again.delivered and again.status == 200  # a retry after a lost answer merges


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_controller_down_falls_back_to_a_file(tmp_path: Path) -> None:
    """With nothing listening, every attempt is made with growing delays, then the incident is
    written to the fallback directory, readable and equal to what was posted."""
    inc = make_incident()
    sleeps: list[float] = []
    config = PostConfig(
        url=f"http://127.0.0.1:{_closed_port()}",
        token=JOB_TOKEN,
        fallback_dir=str(tmp_path),
        attempts=4,
        base_delay_s=1.0,
        max_delay_s=3.0,
        timeout_s=5,
    )
    result = post_incident(inc, config, sleep=sleeps.append)
    assert not result.delivered and result.attempts == 4 and result.status is None
    assert result.error and "cannot reach" in result.error
    assert len(sleeps) == 3
    for got, full in zip(sleeps, (1.0, 2.0, 3.0)):
        assert full / 2 <= got <= full
    assert result.fallback_path is not None and read_incident(result.fallback_path) == inc


class _Scripted(BaseHTTPRequestHandler):
    """Answers with the next (status, headers) of the server's script. A real HTTP peer, used
    because the real API cannot be made to answer 503 or 401 on cue."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, headers = self.server.script.pop(0)  # type: ignore[attr-defined]
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        body = json.dumps(
            {"error": {"status": status, "code": "x", "message": f"scripted {status}"}}
        ).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script = []  # type: ignore[attr-defined]
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_retries_on_503_and_honours_retry_after(scripted: ThreadingHTTPServer, tmp_path: Path) -> None:
    """503 with Retry-After, then 502, then 201: delivered on the third attempt, the first wait
    is the server's Retry-After, and the token was sent as a Bearer header every time."""
    scripted.script += [(503, {"Retry-After": "2"}), (502, {}), (201, {})]  # type: ignore[attr-defined]
    sleeps: list[float] = []
    result = post_incident(
        make_incident(),
        PostConfig(
            url=_url(scripted), token=JOB_TOKEN, fallback_dir=str(tmp_path), base_delay_s=0.1, max_delay_s=5
        ),
        sleep=sleeps.append,
    )
    assert result.delivered and result.attempts == 3 and result.status == 201
    assert sleeps[0] == 2.0 and 0.1 <= sleeps[1] <= 0.2
    assert scripted.seen == [f"Bearer {JOB_TOKEN}"] * 3  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("status", [401, 403, 422])
def test_refused_record_is_not_retried(scripted: ThreadingHTTPServer, tmp_path: Path, status: int) -> None:
    """A 4xx refusal is final: one attempt, the server's message kept, the file written."""
    scripted.script.append((status, {}))  # type: ignore[attr-defined]
    inc = make_incident()
    result = post_incident(
        inc,
        PostConfig(url=_url(scripted), token=JOB_TOKEN, fallback_dir=str(tmp_path)),
        sleep=lambda s: pytest.fail("no retry expected"),
    )
    assert not result.delivered and result.attempts == 1 and result.status == status
    assert result.error == f"HTTP {status}: scripted {status}"
    assert result.fallback_path is not None and read_incident(result.fallback_path) == inc


def test_config_from_env_and_token_file(tmp_path: Path) -> None:
    """from_env: off without a URL; a URL needs a token file; tokens are read from files in the
    'TOKEN' or 'NAME TOKEN' form and never shown in the config's repr."""
    assert PostConfig.from_env({}) is None
    with pytest.raises(PostConfigError):
        PostConfig.from_env({"REPLICHECK_CONTROLLER_URL": "http://ctl:8765"})
    token_file = tmp_path / "job.token"
    token_file.write_text("# job token\ntrainer " + JOB_TOKEN + "\n")
    config = PostConfig.from_env(
        {
            "REPLICHECK_CONTROLLER_URL": "http://ctl:8765",
            "REPLICHECK_JOB_TOKEN_FILE": str(token_file),
            "REPLICHECK_INCIDENT_FALLBACK_DIR": str(tmp_path / "fb"),
        }
    )
    assert config is not None and config.token == JOB_TOKEN and config.fallback_dir == str(tmp_path / "fb")
    assert JOB_TOKEN not in repr(config)
    with pytest.raises(PostConfigError):
        PostConfig(url="ctl:8765", token=JOB_TOKEN)
    with pytest.raises(PostConfigError):
        read_token(tmp_path / "missing")
