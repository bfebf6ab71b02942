"""The HTTP API endpoint by endpoint: tokens, bodies, schema, decisions, errors, OpenAPI."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, SHARED_TOKEN, Live, call, make_incident

from replicheck.controller import State
from replicheck.controller.errors import ConfigError
from replicheck.controller.http import Authenticator, Role, Token, read_token_file
from replicheck.controller.http.auth import RefusalBudget

pytestmark = pytest.mark.timeout(120)

INCIDENTS = "/api/v1/incidents"


def _awaiting(live: Live, **kw: object) -> str:
    """Post an incident and reconcile it to awaiting_approval; return its id."""
    inc = make_incident(**kw)  # type: ignore[arg-type]
    assert call(live.url, "POST", INCIDENTS, inc.to_json(), token=JOB_TOKEN).status == 201
    with live.controller() as ctl:
        ctl.reconcile()
        assert ctl.store.get_record(inc.id).state is State.AWAITING_APPROVAL
    return inc.id


def _refusals(live: Live) -> list[tuple[str, str | None, str]]:
    with live.controller() as ctl:
        return [
            (a.actor, a.incident_id, a.outcome) for a in ctl.store.audit_rows() if a.what == "refused request"
        ]


def _counts(live: Live) -> tuple[int, int]:
    with live.controller() as ctl:
        return len(ctl.records()), len(ctl.store.rejected_rows())


def test_post_incident_stores_and_merges_duplicates(live: Live) -> None:
    """A job-token post stores the incident (201); the same incident again merges (200)."""
    inc = make_incident()
    first = call(live.url, "POST", INCIDENTS, inc.to_json(), token=JOB_TOKEN)
    assert first.status == 201 and first.json() == {"id": inc.id, "new": True}
    assert first.headers["location"] == f"{INCIDENTS}/{inc.id}"
    again = call(live.url, "POST", INCIDENTS, inc.to_json(), token=JOB_TOKEN)
    assert again.status == 200 and again.json()["new"] is False
    with live.controller() as ctl:
        row = ctl.store.get_incident(inc.id)
        assert row.deliveries == 2 and row.incident == inc and row.source == "http:job@127.0.0.1"


@pytest.mark.parametrize(
    "method,path,token,status",
    [
        ("POST", INCIDENTS, None, 401),
        ("POST", INCIDENTS, "not-a-token-at-all-xxxxxxxx", 401),
        ("POST", INCIDENTS, ALICE_TOKEN, 403),
        ("GET", INCIDENTS, None, 401),
        ("GET", INCIDENTS, JOB_TOKEN, 403),
        ("GET", "/api/v1/whoami", "wrong-token-0123456789", 401),
    ],
)
def test_missing_or_wrong_token_refused_and_audited(
    live: Live, method: str, path: str, token: str | None, status: int
) -> None:
    """A missing, unknown or wrong-role token is refused (401/403), audited, and stores nothing."""
    body = make_incident().to_json() if method == "POST" else None
    reply = call(live.url, method, path, body, token=token)
    assert reply.status == status
    err = reply.json()["error"]
    assert err["status"] == status and err["code"] == ("unauthorized" if status == 401 else "forbidden")
    if status == 401:
        assert reply.headers["www-authenticate"] == "Bearer"
    refusals = _refusals(live)
    assert len(refusals) == 1
    actor, incident_id, outcome = refusals[0]
    assert actor == "http:127.0.0.1" and incident_id is None
    assert outcome.startswith(f"{status}: ") and f"{method} {path}" in outcome
    assert _counts(live) == (0, 0)


def test_malformed_authorization_header_refused(live: Live) -> None:
    """An Authorization header that is not 'Bearer <token>' is a 401, even with a valid secret."""
    reply = call(live.url, "GET", INCIDENTS, headers={"Authorization": f"Basic {ALICE_TOKEN}"})
    assert reply.status == 401 and "Bearer" in reply.json()["error"]["message"]


def test_refused_decision_is_audited_on_the_incident(live: Live) -> None:
    """A job token trying to approve is refused (403); the refusal is in that incident's audit
    log and the incident still awaits approval."""
    iid = _awaiting(live)
    reply = call(live.url, "POST", f"{INCIDENTS}/{iid}/approve", {}, token=JOB_TOKEN)
    assert reply.status == 403
    assert [r[1] for r in _refusals(live)] == [iid]
    with live.controller() as ctl:
        assert ctl.store.get_record(iid).state is State.AWAITING_APPROVAL


def test_oversized_body_refused_before_reading(live: Live) -> None:
    """A body announced larger than the limit gets 413 before it is sent; nothing is stored."""
    conn = http.client.HTTPConnection(
        live.url.removeprefix("http://").split(":")[0], int(live.url.rsplit(":", 1)[1]), timeout=30
    )
    conn.putrequest("POST", INCIDENTS)
    conn.putheader("Authorization", f"Bearer {JOB_TOKEN}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 * 1024 * 1024))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "too_large"
    conn.close()
    assert _counts(live) == (0, 0)


def test_oversized_streamed_body_refused(serve: object) -> None:
    """A chunked body without Content-Length that passes the limit gets 413; nothing is stored."""
    live = serve(max_body_bytes=4096)  # type: ignore[operator]
    inc = make_incident()
    data = inc.to_dict()
    data["evidence"] = {"padding": "x" * 8000}
    body = json.dumps(data).encode()
    conn = http.client.HTTPConnection("127.0.0.1", int(live.url.rsplit(":", 1)[1]), timeout=30)
    conn.request(
        "POST",
        INCIDENTS,
        body=iter([body[:2000], body[2000:]]),
        encode_chunked=True,
        headers={
            "Authorization": f"Bearer {JOB_TOKEN}",
            "Content-Type": "application/json",
            "Transfer-Encoding": "chunked",
        },
    )
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()
    assert _counts(live) == (0, 0)
    small = call(live.url, "POST", INCIDENTS, make_incident().to_json(), token=JOB_TOKEN)
    assert small.status == 201  # the limit refuses only what is too large


@pytest.mark.parametrize(
    "body,content_type,status,code",
    [
        (b"{", "application/json", 400, "malformed"),
        (b"\xff\xfe", "application/json", 400, "malformed"),
        # NaN is kept as a string on every path in (one policy with files): not an incident.
        (b'{"a": NaN}', "application/json", 422, "invalid_incident"),
        (b'{"schema": "replicheck.incident", "schema": "x"}', "application/json", 422, "invalid_incident"),
        (b'"\\ud800"', "application/json", 400, "malformed"),
        (b"[]", "application/json", 422, "invalid_incident"),
        (b'{"schema": "replicheck.incident", "version": 2}', "application/json", 422, "invalid_incident"),
        (b"id=1", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ],
)
def test_bad_bodies_refused_and_nothing_stored(
    live: Live, body: bytes, content_type: str, status: int, code: str
) -> None:
    """Malformed, non-JSON and schema-violating bodies get a 4xx JSON error; nothing is stored and
    an incident already stored is untouched."""
    kept = _awaiting(live)
    reply = call(live.url, "POST", INCIDENTS, body, token=JOB_TOKEN, content_type=content_type)
    assert reply.status == status
    assert reply.json()["error"]["code"] == code and reply.json()["error"]["message"]
    assert _counts(live) == (1, 0)
    with live.controller() as ctl:
        assert ctl.store.get_record(kept).state is State.AWAITING_APPROVAL


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("step", -1, "'step' must be a non-negative integer"),
        ("check", "vibes", "'check' must be one of"),
        ("time", "2025-01-01T00:00:00", "needs a UTC offset"),
        ("suspects", [{"rank": 1}], "suspect 'node' must be an object"),
    ],
)
def test_schema_violation_names_the_field(live: Live, field: str, value: object, message: str) -> None:
    """A schema violation is a 422 whose message is the incident parser's, naming the field."""
    data = make_incident().to_dict()
    data[field] = value
    reply = call(live.url, "POST", INCIDENTS, data, token=JOB_TOKEN)
    assert reply.status == 422 and message in reply.json()["error"]["message"]
    assert _counts(live) == (0, 0)


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("id", "team/\u03b1 job 7", "id"),
        ("job_id", "n1 state=idle", "job_id"),
        ("suspect_nodes", ["node[1-4]"], "node name"),
    ],
)
def test_ingest_grammar_violation_is_refused(live: Live, field: str, value: object, named: str) -> None:
    """A body that parses but breaks the ingest grammar (as files are checked) is a 422 naming the
    field, and nothing is stored, not even a rejected row."""
    data = make_incident().to_dict()
    data[field] = value
    reply = call(live.url, "POST", INCIDENTS, data, token=JOB_TOKEN)
    assert reply.status == 422 and named in reply.json()["error"]["message"]
    assert _counts(live) == (0, 0)


def test_list_and_show(live: Live) -> None:
    """Operators list incidents (optionally by state) and see one in full, with what a decision does."""
    iid = _awaiting(live)
    other = make_incident(job="job2")
    call(live.url, "POST", INCIDENTS, other.to_json(), token=JOB_TOKEN)
    listing = call(live.url, "GET", INCIDENTS, token=ALICE_TOKEN).json()
    assert {i["id"]: i["state"] for i in listing["incidents"]} == {
        iid: "awaiting_approval",
        other.id: "detected",
    }
    only = call(live.url, "GET", f"{INCIDENTS}?state=awaiting_approval", token=ALICE_TOKEN).json()
    assert [i["id"] for i in only["incidents"]] == [iid]
    bad = call(live.url, "GET", f"{INCIDENTS}?state=sleeping", token=ALICE_TOKEN)
    assert bad.status == 422 and bad.json()["error"]["code"] == "invalid"
    detail = call(live.url, "GET", f"{INCIDENTS}/{iid}", token=ALICE_TOKEN).json()
    assert detail["decision_pending"] is True and detail["record"]["cordoned"] == ["n2"]
    assert detail["incident"]["evidence"]["replay"]["pairs"][0]["agree"] is False
    assert (
        "n2" in detail["consequences"]["approve"]
        and "checkpoint step 30" in detail["consequences"]["approve"]
    )
    assert "cordon on n2 is lifted" in detail["consequences"]["dismiss"]
    assert any(a["what"] == "detected -> cordoned" for a in detail["audit"])
    missing = call(live.url, "GET", f"{INCIDENTS}/nope", token=ALICE_TOKEN)
    assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"


def test_approve_records_the_token_holder(live: Live) -> None:
    """Approving with a named token records that name as approver, with how the request came,
    and the controller then replaces the node."""
    iid = _awaiting(live)
    reply = call(live.url, "POST", f"{INCIDENTS}/{iid}/approve", token=ALICE_TOKEN)
    assert reply.status == 200 and reply.json()["record"]["state"] == "approved"
    with live.controller() as ctl:
        record = ctl.store.get_record(iid)
        assert record.approved_by == "alice"
        rows = [(a.actor, a.what, a.outcome) for a in ctl.store.audit_rows(iid)]
        assert ("alice", "approve requested", "HTTP from 127.0.0.1, operator token 'alice'") in rows
        assert ("alice", "awaiting_approval -> approved", "approved by alice") in rows
        ctl.reconcile()
        assert ctl.store.get_record(iid).state is State.RESUMED


def test_shared_token_needs_a_name(live: Live) -> None:
    """A shared operator token must say who decides; the name is recorded as given."""
    iid = _awaiting(live)
    nameless = call(live.url, "POST", f"{INCIDENTS}/{iid}/dismiss", {}, token=SHARED_TOKEN)
    assert nameless.status == 422 and "'by'" in nameless.json()["error"]["message"]
    ok = call(live.url, "POST", f"{INCIDENTS}/{iid}/dismiss", {"by": "bob"}, token=SHARED_TOKEN)
    assert ok.status == 200 and ok.json()["record"]["dismissed_by"] == "bob"
    with live.controller() as ctl:
        via = [a.outcome for a in ctl.store.audit_rows(iid) if a.what == "dismiss requested"]
    assert via == ["HTTP from 127.0.0.1, shared operator token (name given by the requester)"]


def test_named_token_cannot_claim_another_name(live: Live) -> None:
    """With a named token, 'by' naming someone else is refused and nothing is decided."""
    iid = _awaiting(live)
    reply = call(live.url, "POST", f"{INCIDENTS}/{iid}/approve", {"by": "mallory"}, token=ALICE_TOKEN)
    assert reply.status == 422
    with live.controller() as ctl:
        assert ctl.store.get_record(iid).state is State.AWAITING_APPROVAL


@pytest.mark.parametrize("body", [{"by": ""}, {"by": "x\ny"}, {"expect_state": "nope"}, {"extra": 1}, "[1"])
def test_invalid_decision_bodies(live: Live, body: object) -> None:
    """Invalid decision bodies are 422 JSON errors and decide nothing."""
    iid = _awaiting(live)
    reply = call(live.url, "POST", f"{INCIDENTS}/{iid}/approve", body, token=SHARED_TOKEN)  # type: ignore[arg-type]
    assert reply.status == 422 and reply.json()["error"]["status"] == 422
    with live.controller() as ctl:
        assert ctl.store.get_record(iid).state is State.AWAITING_APPROVAL


def test_second_decision_and_stale_state_conflict(live: Live) -> None:
    """After a dismissal an approval is a 409; a decision on a state the incident has left is a
    409; an explicit overrule naming the current state is accepted."""
    iid = _awaiting(live)
    other = _awaiting(live, job="job2")
    assert call(live.url, "POST", f"{INCIDENTS}/{iid}/dismiss", token=ALICE_TOKEN).status == 200
    late = call(live.url, "POST", f"{INCIDENTS}/{iid}/approve", token=ALICE_TOKEN)
    assert late.status == 409 and late.json()["error"]["code"] == "conflict"
    stale = call(
        live.url, "POST", f"{INCIDENTS}/{other}/dismiss", {"expect_state": "cordoned"}, token=ALICE_TOKEN
    )
    assert stale.status == 409
    with live.controller(max_replacements=0) as ctl:  # approved, then held by the blast-radius limit
        ctl.approve(other, by="carol")
        ctl.reconcile()
        assert ctl.store.get_record(other).state is State.APPROVED
    again = call(live.url, "POST", f"{INCIDENTS}/{other}/dismiss", token=ALICE_TOKEN)
    assert again.status == 409 and "approved by carol" in again.json()["error"]["message"]
    overrule = call(
        live.url, "POST", f"{INCIDENTS}/{other}/dismiss", {"expect_state": "approved"}, token=ALICE_TOKEN
    )
    assert overrule.status == 200 and overrule.json()["record"]["state"] == "dismissed"


def test_openapi_describes_every_endpoint(live: Live) -> None:
    """/openapi.json lists every API path, both bearer schemes and the incident schema."""
    doc = call(live.url, "GET", "/openapi.json").json()
    assert {
        INCIDENTS,
        f"{INCIDENTS}/{{incident_id}}",
        f"{INCIDENTS}/{{incident_id}}/approve",
        f"{INCIDENTS}/{{incident_id}}/dismiss",
        "/api/v1/whoami",
        "/metrics",
        "/healthz",
    } <= set(doc["paths"])
    schemes = doc["components"]["securitySchemes"]
    assert schemes["jobToken"]["scheme"] == "bearer" and schemes["operatorToken"]["scheme"] == "bearer"
    post = doc["paths"][INCIDENTS]["post"]
    assert post["security"] == [{"jobToken": []}]
    assert (
        post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        == "#/components/schemas/Incident"
    )
    incident = doc["components"]["schemas"]["Incident"]
    assert {"id", "job_id", "step", "check", "schema", "version"} <= set(incident["required"])
    assert "Suspect" in doc["components"]["schemas"]


def test_errors_are_json(live: Live) -> None:
    """Unknown paths and methods get JSON errors; health says the database opens."""
    assert call(live.url, "GET", "/nothing").json()["error"]["code"] == "not_found"
    wrong = call(live.url, "DELETE", INCIDENTS, token=ALICE_TOKEN)
    assert wrong.status == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert call(live.url, "GET", "/healthz").json()["ok"] is True


def test_page_and_security_headers(live: Live) -> None:
    """The page and its script are served with a strict content security policy."""
    page = call(live.url, "GET", "/")
    assert page.status == 200 and b"/static/app.js" in page.body
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert call(live.url, "GET", "/static/app.js").status == 200


def test_token_files(tmp_path: Path) -> None:
    """Token files: named and shared tokens are read; short tokens, bad names, empty files and a
    secret shared by both roles are refused."""
    good = tmp_path / "ops"
    good.write_text("# comment\n\nalice " + "a" * 20 + "\n" + "b" * 20 + "\n")
    tokens = read_token_file(good, Role.OPERATOR)
    assert [(t.name, t.role) for t in tokens] == [("alice", Role.OPERATOR), (None, Role.OPERATOR)]
    assert "aaaa" not in repr(tokens)
    for text in ("short\n", "", "a b c\n", "bad/name " + "c" * 20 + "\n"):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ConfigError):
            read_token_file(bad, Role.JOB)
    with pytest.raises(ConfigError):
        read_token_file(tmp_path / "missing", Role.JOB)
    with pytest.raises(ConfigError, match="different secrets"):
        Authenticator([Token(Role.JOB, b"s" * 20), Token(Role.OPERATOR, b"s" * 20)])


def test_refusal_audit_budget() -> None:
    """Past the per-minute budget refusals are counted, and the count goes into the next audited one."""
    now = [0.0]
    budget = RefusalBudget(2, clock=lambda: now[0])
    assert [budget.take() for _ in range(4)] == [(True, 0), (True, 0), (False, 0), (False, 0)]
    now[0] = 61.0
    assert budget.take() == (True, 2)


def test_odd_incident_ids_round_trip(live: Live) -> None:
    """An id with a '/' (a Kubernetes namespace/name job) is stored, shown and decided via its
    percent-encoded URL (the Location header is encoded too)."""
    from urllib.parse import quote

    inc = make_incident()
    data = inc.to_dict()
    data["id"] = "team/llm-s7-replay"
    reply = call(live.url, "POST", INCIDENTS, data, token=JOB_TOKEN)
    assert reply.status == 201
    path = f"{INCIDENTS}/{quote(data['id'], safe='')}"
    assert reply.headers["location"] == path
    with live.controller() as ctl:
        ctl.reconcile()
    assert call(live.url, "GET", path, token=ALICE_TOKEN).json()["incident"]["id"] == data["id"]
    assert (
        call(live.url, "POST", path + "/approve", token=ALICE_TOKEN).json()["record"]["approved_by"]
        == "alice"
    )
