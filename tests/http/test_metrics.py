"""The /metrics endpoint scraped: incidents by state and classification, actions by kind and
result, failures, detection-to-cordon and detection-to-approval times, HTTP counters."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, Live, call, iso, make_incident
from prometheus_client.parser import text_string_to_metric_families

from replicheck.controller import Controller, ControllerConfig, LocalBackend

pytestmark = pytest.mark.timeout(120)

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def scrape(live: Live) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = call(live.url, "GET", "/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_scraped(live: Live) -> None:
    """Scraped values match what happened: 30 s detection-to-cordon for both incidents, 630 s
    detection-to-approval for the approved one, one replacement done, one refused request."""
    now = [T0]
    clock = lambda: now[0]  # noqa: E731
    for job in ("a", "b"):
        inc = make_incident(job=job, time=iso(T0 - dt.timedelta(seconds=30)))
        assert call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN).status == 201
    with Controller(
        live.db, config=ControllerConfig(apply=True, checkpoint_roots=("/ckpt",)), clock=clock
    ) as ctl:
        ctl.reconcile()
        now[0] = T0 + dt.timedelta(seconds=600)
        ctl.approve(make_incident(job="a").id, by="alice")
        ctl.reconcile()
    call(live.url, "GET", "/api/v1/incidents")  # refused: no token
    call(live.url, "GET", "/api/v1/incidents", token=ALICE_TOKEN)
    m = scrape(live)
    assert value(m, "replicheck_incidents", state="resumed", classification="persistent") == 1
    assert value(m, "replicheck_incidents", state="awaiting_approval", classification="persistent") == 1
    assert value(m, "replicheck_incidents", state="failed", classification="ambiguous") == 0
    assert value(m, "replicheck_actions", kind="replace", result="done") == 1
    assert value(m, "replicheck_actions", kind="cordon", result="done") == 2
    assert value(m, "replicheck_actions", kind="resume", result="done") == 1
    assert value(m, "replicheck_action_failed_attempts", kind="replace") == 0
    assert value(m, "replicheck_incidents_failed") == 0
    assert value(m, "replicheck_detection_to_cordon_seconds_count") == 2
    assert value(m, "replicheck_detection_to_cordon_seconds_sum") == pytest.approx(60.0)
    assert value(m, "replicheck_detection_to_cordon_seconds_bucket", le="15.0") == 0
    assert value(m, "replicheck_detection_to_cordon_seconds_bucket", le="30.0") == 2
    assert value(m, "replicheck_detection_to_approval_seconds_count") == 1
    assert value(m, "replicheck_detection_to_approval_seconds_sum") == pytest.approx(630.0)
    assert value(m, "replicheck_http_auth_refusals_total", status="401") == 1
    assert (
        value(m, "replicheck_http_requests_total", method="GET", route="/api/v1/incidents", status="200") == 1
    )
    assert (
        value(m, "replicheck_http_requests_total", method="POST", route="/api/v1/incidents", status="201")
        == 2
    )


def test_failures_and_rejected_bodies_counted(live: Live) -> None:
    """Failed backend attempts (a cordon of a node the cluster does not know) and refused
    request bodies show up in their series."""
    inc = make_incident(job="f", nodes=("ghost",))
    LocalBackend(live.db).add_job("f", ("ghost",))  # job f ran on a node the cluster no longer knows
    call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN)
    call(live.url, "POST", "/api/v1/incidents", b"{", token=JOB_TOKEN)
    call(live.url, "POST", "/api/v1/incidents", b"[]", token=JOB_TOKEN)
    with Controller(live.db, config=ControllerConfig(apply=True)) as ctl:
        ctl.reconcile()
    m = scrape(live)
    assert value(m, "replicheck_action_failed_attempts", kind="cordon") == 1
    assert value(m, "replicheck_actions", kind="cordon", result="failed") == 1
    assert value(m, "replicheck_incidents_failed") == 1
    assert value(m, "replicheck_incidents", state="failed", classification="persistent") == 1
    assert value(m, "replicheck_http_rejected_bodies_total", reason="malformed") == 1
    assert value(m, "replicheck_http_rejected_bodies_total", reason="schema") == 1
