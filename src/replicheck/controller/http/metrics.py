"""Prometheus series of the controller, computed from the database at scrape time (so every
controller process and restart reports the same numbers), plus this server's own counters.

Needs ``prometheus-client`` (``pip install 'replicheck[metrics]'``); imported only when the
server is built with metrics.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from replicheck.controller.model import ActionKind, State
from replicheck.controller.store import Store
from replicheck.incident import CLASSIFICATIONS

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("metrics need prometheus-client: pip install 'replicheck[metrics]'") from exc

BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
"""Histogram buckets for detection-to-cordon and detection-to-approval times."""

ACTION_RESULTS = ("pending", "in_flight", "done", "skipped", "failed", "cancelled")


class StoreCollector(Collector):
    """Reads the controller database on each scrape."""

    def __init__(self, db_path: str | Path) -> None:
        self.db_path = Path(db_path)

    def describe(self) -> Iterable[Metric]:
        return []  # computed at scrape time; not checked at registration

    def collect(self) -> Iterator[Metric]:
        store = Store(self.db_path)
        try:
            records = store.list_records()
            actions = store.actions()
            audit = store.audit_rows()
            rejected = len(store.rejected_rows())
            detected = {
                r.incident_id: _parse(store.get_incident(r.incident_id).incident.time) for r in records
            }
        finally:
            store.close()

        incidents = GaugeMetricFamily(
            "replicheck_incidents",
            "Incidents by current state and classification",
            labels=["state", "classification"],
        )
        by_state = Counter((r.state.value, r.classification) for r in records)
        for state in State:
            for cls in CLASSIFICATIONS:
                incidents.add_metric([state.value, cls], by_state[(state.value, cls)])
        yield incidents

        acts = GaugeMetricFamily(
            "replicheck_actions",
            "Actions by kind and result (skipped: done, nothing needed doing)",
            labels=["kind", "result"],
        )
        failed_attempts = GaugeMetricFamily(
            "replicheck_action_failed_attempts",
            "Backend calls that failed (retried or final), by action kind",
            labels=["kind"],
        )
        by_result: Counter[tuple[str, str]] = Counter()
        failures: Counter[str] = Counter()
        for a in actions:
            result: str = (
                "skipped" if a.status == "done" and a.result and a.result.get("skipped") else a.status
            )
            by_result[(a.kind.value, result)] += 1
            succeeded_or_running = 1 if a.status in ("done", "in_flight") else 0
            failures[a.kind.value] += max(0, a.attempts - succeeded_or_running)
        for kind in ActionKind:
            for result in ACTION_RESULTS:
                acts.add_metric([kind.value, result], by_result[(kind.value, result)])
            failed_attempts.add_metric([kind.value], failures[kind.value])
        yield acts
        yield failed_attempts

        failed = GaugeMetricFamily(
            "replicheck_incidents_failed", "Incidents in the failed state (a person must look)"
        )
        failed.add_metric([], sum(1 for r in records if r.state is State.FAILED))
        yield failed
        yield GaugeMetricFamily(
            "replicheck_rejected_inputs", "Malformed or unknown-version incident inputs kept", value=rejected
        )

        cordoned_at: dict[str, _dt.datetime] = {}
        for row in audit:
            if row.incident_id and row.what.endswith("-> cordoned") and row.incident_id not in cordoned_at:
                cordoned_at[row.incident_id] = _parse(row.at)
        to_cordon = [(cordoned_at[i] - detected[i]).total_seconds() for i in cordoned_at if i in detected]
        to_approval = [
            (_parse(r.approved_at) - detected[r.incident_id]).total_seconds()
            for r in records
            if r.approved_at
        ]
        yield _histogram(
            "replicheck_detection_to_cordon_seconds",
            "Time from the incident's detection (its time) to the controller's cordon",
            to_cordon,
        )
        yield _histogram(
            "replicheck_detection_to_approval_seconds",
            "Time from the incident's detection to its approval (person or auto-approve)",
            to_approval,
        )


def _histogram(name: str, doc: str, values: list[float]) -> HistogramMetricFamily:
    values = [max(0.0, v) for v in values]  # the job's and the controller's clocks may differ slightly
    buckets: list[tuple[str, float]] = [(str(b), float(sum(1 for v in values if v <= b))) for b in BUCKETS_S]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))


def _parse(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text)


class ServerMetrics:
    """This HTTP server's own counters, in a registry with the store collector."""

    def __init__(self, db_path: str | Path) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(db_path))
        self.requests = PromCounter(
            "replicheck_http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.refused = PromCounter(
            "replicheck_http_auth_refusals",
            "Requests refused for a missing, unknown or wrong-role token",
            ["status"],
            registry=self.registry,
        )
        self.bad_bodies = PromCounter(
            "replicheck_http_rejected_bodies",
            "Request bodies refused (too_large, malformed, schema)",
            ["reason"],
            registry=self.registry,
        )

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
