"""Property-based fuzzing of incident posts: no payload makes the server answer 5xx, and every
accepted payload is stored and readable back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, Live, call, make_incident
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(600)

BASE = make_incident().to_dict()

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_incident(draw: st.DrawFn) -> dict[str, Any]:
    """A valid incident with some fields dropped, replaced by arbitrary JSON, or added."""
    data: dict[str, Any] = json.loads(json.dumps(BASE))
    data["id"] = draw(st.text(min_size=1, max_size=30))
    for key in draw(st.lists(st.sampled_from(sorted(BASE)), max_size=4, unique=True)):
        if draw(st.booleans()):
            data.pop(key)
        else:
            data[key] = draw(json_values)
    if draw(st.booleans()):
        data[draw(st.text(max_size=10))] = draw(json_values)
    if draw(st.booleans()):
        data["suspects"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "rank": st.integers(-2, 2**40),
                        "node": st.fixed_dictionaries(
                            {"name": st.text(max_size=10)}, optional={"hostname": json_values}
                        ),
                    }
                ),
                max_size=3,
            )
        )
    return data


payloads = (
    mutated_incident().map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
    | mutated_incident().map(lambda d: json.dumps(d).encode()[: max(1, len(json.dumps(d)) // 2)])
)


@pytest.fixture(scope="module")
def module_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from httpkit import cluster, write_tokens

    from replicheck.controller.http import BackgroundServer, HttpConfig, Role, create_app, read_token_file

    d = tmp_path_factory.mktemp("fuzz")
    db = d / "ctl.db"
    cluster(db)
    job, operator = write_tokens(d)
    tokens = read_token_file(job, Role.JOB) + read_token_file(operator, Role.OPERATOR)
    server = BackgroundServer(
        create_app(HttpConfig(db_path=str(db), tokens=tokens, max_body_bytes=65536)), "127.0.0.1", 0
    ).start()
    yield Live(server.url, db, job, operator)
    server.stop()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=payloads)
def test_no_incident_payload_gives_5xx(module_live: Live, body: bytes) -> None:
    """Whatever is posted, the answer is 2xx or a 4xx JSON error; what was accepted can be read back."""
    reply = call(module_live.url, "POST", "/api/v1/incidents", body, token=JOB_TOKEN)
    assert reply.status < 500, (reply.status, reply.body[:300])
    if reply.status in (200, 201):
        iid = reply.json()["id"]
        with module_live.controller() as ctl:
            assert ctl.store.get_incident(iid).incident.id == iid
    else:
        assert 400 <= reply.status < 500 and reply.json()["error"]["message"]


def test_accepted_fuzzed_incidents_show_and_list(module_live: Live) -> None:
    """After the fuzzing, listing works (no stored record breaks the API)."""
    reply = call(module_live.url, "GET", "/api/v1/incidents", token=ALICE_TOKEN)
    assert reply.status == 200
    for item in reply.json()["incidents"][:50]:
        from urllib.parse import quote

        shown = call(
            module_live.url, "GET", "/api/v1/incidents/" + quote(item["id"], safe=""), token=ALICE_TOKEN
        )
        assert shown.status < 500


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=60))
def test_no_authorization_header_gives_5xx(module_live: Live, header: str) -> None:
    """Arbitrary Authorization headers on an operator endpoint are refused with 401, never 5xx."""
    reply = call(
        module_live.url, "GET", "/api/v1/incidents", headers={"Authorization": header.strip() or "x"}
    )
    assert reply.status == 401 and reply.json()["error"]["code"] == "unauthorized"
