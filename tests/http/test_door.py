"""Resource limits at the door and one validator on every path in (issue 27): unknown methods
under one label, deep or huge evidence refused over HTTP, proxy headers ignored unless
configured, per-credential rate limits and quotas, bounded audit rows, idle connections closed,
liveness in /healthz, a merged copy with a long id kept, and a poster that never raises."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, Live, call, cluster, make_incident, write_tokens

from replicheck.controller.errors import ConfigError
from replicheck.controller.http import (
    BackgroundServer,
    HttpConfig,
    Role,
    ServerLimits,
    create_app,
    read_token_file,
)
from replicheck.incident_post import PostConfig, post_incident

INCIDENTS = "/api/v1/incidents"


def _reads_answer(live: Live) -> None:
    """Every read answers: the list, each incident, /metrics, /healthz."""
    listing = call(live.url, "GET", INCIDENTS, token=ALICE_TOKEN)
    assert listing.status == 200
    for item in listing.json()["incidents"]:
        assert call(live.url, "GET", f"{INCIDENTS}/{item['id']}", token=ALICE_TOKEN).status == 200
    assert call(live.url, "GET", "/metrics").status == 200
    assert call(live.url, "GET", "/healthz").status == 200


def test_distinct_methods_counted_under_one_label(live: Live) -> None:
    """3,000 requests with distinct invented methods leave /metrics under 1 MB: they are counted
    as method OTHER (on the old code each one was a label value: 84 MB)."""
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    statuses: set[bytes] = set()
    answered = 0
    for batch in range(30):  # 100 pipelined requests per connection (one at a time is Nagle-slow)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(
                b"".join(
                    f"X{batch:02d}{i:03d}{'M' * 40} /nowhere/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                    for i in range(100)
                )
                + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        heads = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
        answered += len(heads) - 1
        statuses.update(heads[:-1])
    assert answered == 3000
    assert statuses <= {b"404", b"405"}
    metrics = call(live.url, "GET", "/metrics").body
    assert len(metrics) < 1_000_000
    assert b'method="OTHER"' in metrics
    assert b"X00001" not in metrics


def _deep(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"d": value}
    return value


def test_deep_or_huge_evidence_refused_over_http(live: Live) -> None:
    """Evidence nested 40 deep, an integer of 2**70, or a duplicate key, posted with the job
    token, is a 4xx (the file path's checks, one validator) and nothing is stored; every read
    still answers. On the old code they were stored (201) and broke /metrics and the incident."""
    good = make_incident(step=1)
    assert call(live.url, "POST", INCIDENTS, good.to_json(), token=JOB_TOKEN).status == 201
    tried = 0
    for step, evidence in ((2, _deep(40)), (3, {"big": 2**70}), (4, {"neg": -(2**70)})):
        body = dataclasses.replace(make_incident(step=step), evidence=evidence).to_json()  # type: ignore[arg-type]
        reply = call(live.url, "POST", INCIDENTS, body, token=JOB_TOKEN)
        tried += 1
        assert reply.status == 422, reply.body
        assert reply.json()["error"]["code"] == "invalid_incident"
    dup = (
        make_incident(step=5)
        .to_json()
        .replace('"check": "replay"', '"check": "replay", "check": "weights"', 1)
    )
    assert call(live.url, "POST", INCIDENTS, dup, token=JOB_TOKEN).status == 422
    ids = [i["id"] for i in call(live.url, "GET", INCIDENTS, token=ALICE_TOKEN).json()["incidents"]]
    assert ids == [good.id]
    _reads_answer(live)


def test_nan_evidence_kept_as_string_over_http(live: Live) -> None:
    """NaN in evidence is kept as the string "NaN" over HTTP as in files (one policy), not refused."""
    body = make_incident(step=7).to_json().replace('"evidence": {', '"evidence": {"loss": NaN, ', 1)
    reply = call(live.url, "POST", INCIDENTS, body, token=JOB_TOKEN)
    assert reply.status == 201, reply.body
    shown = call(live.url, "GET", f"{INCIDENTS}/{reply.json()['id']}", token=ALICE_TOKEN)
    assert json.loads(shown.body)["incident"]["evidence"]["loss"] == "NaN"


def test_a_damaged_row_is_quarantined_and_the_rest_served(live: Live) -> None:
    """A stored incident whose body no longer parses (an older build stored 2**70) answers 409
    "quarantined" instead of 503; the list, /metrics and the other incidents still answer."""
    good, bad = make_incident(step=1), make_incident(step=2)
    for inc in (good, bad):
        assert call(live.url, "POST", INCIDENTS, inc.to_json(), token=JOB_TOKEN).status == 201
    with sqlite3.connect(live.db) as db:
        db.execute(
            "UPDATE incidents SET body=? WHERE id=?", ('{"evidence": {"x": ' + str(2**70) + "}}", bad.id)
        )
    shown = call(live.url, "GET", f"{INCIDENTS}/{bad.id}", token=ALICE_TOKEN)
    assert shown.status == 409 and shown.json()["error"]["code"] == "quarantined"
    assert call(live.url, "GET", f"{INCIDENTS}/{good.id}", token=ALICE_TOKEN).status == 200
    listing = call(live.url, "GET", INCIDENTS, token=ALICE_TOKEN).json()
    assert [q["key"] for q in listing["quarantined"]] == [bad.id]
    metrics = call(live.url, "GET", "/metrics").body.decode()
    assert "replicheck_quarantined_rows 1.0" in metrics


def test_forwarded_for_not_trusted_by_default(live: Live) -> None:
    """X-Forwarded-For from 127.0.0.1 is not believed (uvicorn's default trusts it): the refusal
    is audited with the socket's peer address."""
    reply = call(
        live.url, "GET", INCIDENTS, token="nope-0123456789abcdef", headers={"X-Forwarded-For": "6.6.6.6"}
    )
    assert reply.status == 401
    with sqlite3.connect(live.db) as db:
        actors = [r[0] for r in db.execute("SELECT actor FROM audit WHERE what='refused request'")]
    assert actors == ["http:127.0.0.1"]


def test_trusted_proxy_must_be_an_address_or_network() -> None:
    """--trusted-proxy takes IP addresses and networks only: a typo is a clear ConfigError at
    start (before: accepted, so the proxy's X-Forwarded-For was silently never believed)."""
    assert ServerLimits(trusted_proxies=("10.0.0.5", "10.0.0.0/24", "::1")).trusted_proxies
    for bad in ("not-an-ip", "10.0.0.1/24", "*"):
        with pytest.raises(ConfigError, match="--trusted-proxy"):
            ServerLimits(trusted_proxies=(bad,))


def test_rate_limit_per_credential(serve: Callable[..., Live]) -> None:
    """Beyond its burst a credential gets 429 with Retry-After; another credential is unaffected."""
    live = serve(requests_per_minute=20)  # bursts of 10
    statuses = [call(live.url, "GET", "/api/v1/whoami", token=ALICE_TOKEN).status for _ in range(12)]
    assert statuses[:10] == [200] * 10 and statuses[10:] == [429, 429]
    limited = call(live.url, "GET", "/api/v1/whoami", token=ALICE_TOKEN)
    assert int(limited.headers["retry-after"]) >= 1
    assert call(live.url, "POST", INCIDENTS, make_incident().to_json(), token=JOB_TOKEN).status == 201


def test_storage_quota_per_credential(serve: Callable[..., Live]) -> None:
    """A job credential stores at most `incidents_per_day` new incidents (429 after); a copy of one
    already stored still merges (200)."""
    live = serve(incidents_per_day=2)
    first, second, third = (make_incident(step=s) for s in (1, 2, 3))
    assert call(live.url, "POST", INCIDENTS, first.to_json(), token=JOB_TOKEN).status == 201
    assert call(live.url, "POST", INCIDENTS, second.to_json(), token=JOB_TOKEN).status == 201
    over = call(live.url, "POST", INCIDENTS, third.to_json(), token=JOB_TOKEN)
    assert over.status == 429 and over.json()["error"]["code"] == "quota"
    assert call(live.url, "POST", INCIDENTS, first.to_json(), token=JOB_TOKEN).status == 200


def test_audit_rows_of_long_refused_paths_are_cut(live: Live) -> None:
    """A refused request for a 15 KB path writes an audit row of about 2 KB, not 15 KB."""
    path = "/api/v1/incidents/" + "a" * 15000
    assert call(live.url, "GET", path, token="nope-0123456789abcdef").status == 401
    with sqlite3.connect(live.db) as db:
        (size,) = db.execute("SELECT MAX(LENGTH(outcome)) FROM audit WHERE what='refused request'").fetchone()
    assert size < 2200


def test_merged_copy_with_a_long_id_is_kept(live: Live) -> None:
    """A differing copy of an incident whose id is at the length limit is stored under a derived
    id that fits (201, Location names it); on the old code it answered 200 and was dropped."""
    long_id = "j" * 300 + "-s40-replay"
    first = dataclasses.replace(make_incident(), id=long_id)
    other = dataclasses.replace(first, step=41)
    assert call(live.url, "POST", INCIDENTS, first.to_json(), token=JOB_TOKEN).status == 201
    reply = call(live.url, "POST", INCIDENTS, other.to_json(), token=JOB_TOKEN)
    assert reply.status == 201, reply.body
    derived = reply.json()["id"]
    assert derived != long_id and len(derived) <= 320
    ids = {i["id"] for i in call(live.url, "GET", INCIDENTS, token=ALICE_TOKEN).json()["incidents"]}
    assert ids == {long_id, derived}


def test_healthz_reports_a_stale_loop(tmp_path: Path) -> None:
    """/healthz answers 503 when the acting loop of the process has not completed a pass within
    its window, 200 while it has."""
    db = tmp_path / "ctl.db"
    cluster(db)
    job, operator = write_tokens(tmp_path)
    tokens = read_token_file(job, Role.JOB) + read_token_file(operator, Role.OPERATOR)
    state = {"recent": True}
    app = create_app(HttpConfig(db_path=str(db), tokens=tokens), liveness=lambda: {"acting": True, **state})
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        assert call(server.url, "GET", "/healthz").status == 200
        state["recent"] = False
        stale = call(server.url, "GET", "/healthz")
        assert stale.status == 503 and stale.json()["loop"]["recent"] is False


def test_idle_connection_closed_after_header_timeout(tmp_path: Path) -> None:
    """A connection that sends no request headers is closed after the header timeout, and one that
    trickles its body gets 408 after the body timeout."""
    db = tmp_path / "ctl.db"
    cluster(db)
    job, operator = write_tokens(tmp_path)
    tokens = read_token_file(job, Role.JOB) + read_token_file(operator, Role.OPERATOR)
    app = create_app(HttpConfig(db_path=str(db), tokens=tokens, body_timeout_s=0.5))
    with BackgroundServer(app, "127.0.0.1", 0, limits=ServerLimits(header_timeout_s=0.5)) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        idle = socket.create_connection((host, int(port)), timeout=5)
        started = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < 4
        idle.close()
        slow = socket.create_connection((host, int(port)), timeout=5)
        slow.sendall(
            b"POST /api/v1/incidents HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + JOB_TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        answer = slow.recv(4096)
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer


def test_post_incident_never_raises(tmp_path: Path) -> None:
    """With the controller unreachable and a fallback directory that cannot be written, the poster
    returns a result saying both failed instead of raising OSError."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    config = PostConfig(
        url=f"http://127.0.0.1:{port}", token=JOB_TOKEN, fallback_dir=str(blocker / "sub"), attempts=2
    )
    result = post_incident(make_incident(), config, sleep=lambda _: None)
    assert not result.delivered and result.fallback_path is None
    assert result.error is not None and "fallback" in result.error


def test_metrics_do_not_load_stored_content(tmp_path: Path) -> None:
    """A scrape counts with SQL instead of loading rows: with 40 rejected inputs of 1 MiB each and
    an incident whose stored body no longer parses, collecting allocates well under their size
    and does not fail (the old code loaded every body and rejected file, and raised on the bad one)."""
    import tracemalloc

    from replicheck.controller import Controller
    from replicheck.controller.http.metrics import StoreCollector

    db = tmp_path / "ctl.db"
    cluster(db)
    with Controller(db) as ctl:
        ctl.ingest(make_incident())
        with ctl.store.transaction():
            for i in range(40):
                ctl.store.reject(f"junk-{i}", "invalid", bytes([i]) * (1 << 20), "2025-01-01T00:00:00+00:00")
            ctl.store.connection.execute("UPDATE incidents SET body='{broken'")
    tracemalloc.start()
    try:
        families = {m.name: m for m in StoreCollector(db).collect()}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert families["replicheck_rejected_inputs"].samples[0].value == 40
    assert peak < 8 * (1 << 20), peak
