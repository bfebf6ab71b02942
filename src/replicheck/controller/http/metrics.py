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
from typing import Any

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
    """Reads the controller database on each scrape, with ``COUNT``/``GROUP BY`` queries over
    indexed columns: no incident body, record or rejected file is loaded into this process, so
    a scrape costs the same memory however much junk is stored, and a damaged row cannot fail it."""

    def __init__(self, db_path: str | Path) -> None:
        self.db_path = Path(db_path)

    def describe(self) -> Iterable[Metric]:
        return []  # computed at scrape time; not checked at registration

    def collect(self) -> Iterator[Metric]:
        store = Store(self.db_path, busy_timeout_s=5.0)
        try:
            db = store.connection
            by_state = {
                (str(state), str(cls)): int(n)
                for state, cls, n in db.execute(
                    "SELECT state, CASE WHEN json_valid(data) THEN json_extract(data, '$.classification') END,"
                    " COUNT(*) FROM records GROUP BY 1, 2"
                )
            }
            by_result: dict[tuple[str, str], int] = {}
            failures: Counter[str] = Counter()
            for kind, status, skipped, n, failed in db.execute(
                "SELECT kind, status, status = 'done' AND result LIKE '%\"skipped\"%', COUNT(*),"
                " SUM(MAX(0, attempts - (status IN ('done', 'in_flight')))) FROM actions GROUP BY 1, 2, 3"
            ):
                result = "skipped" if skipped else str(status)
                by_result[(str(kind), result)] = by_result.get((str(kind), result), 0) + int(n)
                failures[str(kind)] += int(failed or 0)
            rejected = store.count("SELECT COUNT(*) FROM rejected")
            quarantined = store.count("SELECT COUNT(*) FROM quarantine")
            last_pass = store.get_meta("last_pass_at")
            # Detection (the incident's time) to cordon and to approval, one row per incident.
            to_cordon = _seconds(
                db.execute(
                    "SELECT CASE WHEN json_valid(i.body) THEN json_extract(i.body, '$.time') END, MIN(a.at)"
                    " FROM audit a JOIN incidents i ON i.id = a.incident_id"
                    " WHERE a.what LIKE '%-> cordoned' GROUP BY a.incident_id"
                )
            )
            to_approval = _seconds(
                db.execute(
                    "SELECT CASE WHEN json_valid(i.body) THEN json_extract(i.body, '$.time') END,"
                    " json_extract(r.data, '$.approved_at')"
                    " FROM records r JOIN incidents i ON i.id = r.incident_id"
                    " WHERE json_valid(r.data) AND json_extract(r.data, '$.approved_at') IS NOT NULL"
                )
            )
        finally:
            store.close()

        incidents = GaugeMetricFamily(
            "replicheck_incidents",
            "Incidents by current state and classification",
            labels=["state", "classification"],
        )
        for state in State:
            for cls in CLASSIFICATIONS:
                incidents.add_metric([state.value, cls], by_state.get((state.value, cls), 0))
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
        for kind in ActionKind:
            for result in ACTION_RESULTS:
                acts.add_metric([kind.value, result], by_result.get((kind.value, result), 0))
            failed_attempts.add_metric([kind.value], failures[kind.value])
        yield acts
        yield failed_attempts

        failed = GaugeMetricFamily(
            "replicheck_incidents_failed", "Incidents in the failed state (a person must look)"
        )
        failed.add_metric([], sum(n for (state, _), n in by_state.items() if state == State.FAILED.value))
        yield failed
        yield GaugeMetricFamily(
            "replicheck_rejected_inputs", "Malformed or unknown-version incident inputs kept", value=rejected
        )
        yield GaugeMetricFamily(
            "replicheck_quarantined_rows",
            "Stored rows that could not be read, set aside and skipped (incidents list shows them)",
            value=quarantined,
        )
        if last_pass is not None:
            yield GaugeMetricFamily(
                "replicheck_controller_last_pass_timestamp_seconds",
                "When the acting controller last completed a reconcile pass (Unix time)",
                value=_parse(last_pass).timestamp(),
            )
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


def _seconds(rows: Iterable[tuple[Any, Any]]) -> list[float]:
    out = []
    for start, end in rows:
        try:
            out.append((_parse(str(end)) - _parse(str(start))).total_seconds())
        except (TypeError, ValueError):
            continue  # a time that does not parse is left out of the histogram, not fatal
    return out


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
            "Request bodies refused (too_large, malformed, schema, content_type, timeout)",
            ["reason"],
            registry=self.registry,
        )
        self.limited = PromCounter(
            "replicheck_http_limited",
            "Requests refused with 429: over a credential's rate limit (rate) or storage quota (quota)",
            ["limit"],
            registry=self.registry,
        )

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
