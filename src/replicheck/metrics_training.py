"""Per-rank training-side counters for Prometheus: guarded steps (plain or verified), replica
checks, mismatches (incidents raised) and seconds spent in guarded steps of each kind.

It wraps ``Guard.step`` from outside, so the guard is unchanged and a job that does not use it
pays nothing. Counting is standard library; exporting (``start_http_server``,
``write_textfile``, ``exposition``) needs ``prometheus-client`` (``replicheck[metrics]``).

Time spent in checks is not measured inside the guard; with these series it is estimated as
``step_seconds{kind="verified"} - steps{kind="verified"} * step_seconds{kind="plain"} /
steps{kind="plain"}`` (the extra time of a verifying step over an ordinary one).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replicheck.guard import Guard, StepResult


class TrainingMetrics:
    """Counters for one rank of one job. Thread-safe; cheap enough to call on every step."""

    def __init__(self, *, job_id: str, rank: int, clock: Callable[[], float] = time.perf_counter) -> None:
        if not job_id:
            raise ValueError("job_id must not be empty")
        if rank < 0:
            raise ValueError("rank must be >= 0")
        self.job_id = job_id
        self.rank = rank
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: Counter[str] = Counter()
        self._seconds: dict[str, float] = {}
        self._replica_checks = 0
        self._mismatches: Counter[str] = Counter()
        self._registry: Any = None

    def step(self, guard: Guard, *microbatches: Any) -> StepResult:
        """``guard.step(*microbatches)``, counted and timed; CorruptionDetected is counted as a
        mismatch (by the check that fired) and re-raised unchanged."""
        from replicheck.guard import CorruptionDetected

        start = self._clock()
        try:
            result = guard.step(*microbatches)
        except CorruptionDetected as exc:
            self.record_mismatch(exc.incident.check, self._clock() - start)
            raise
        self.record_step(
            verified=result.verified, replicas_checked=result.replicas_checked, seconds=self._clock() - start
        )
        return result

    def record_step(self, *, verified: bool, replicas_checked: bool, seconds: float) -> None:
        """Count one step whose update was applied."""
        kind = "verified" if verified else "plain"
        with self._lock:
            self._steps[kind] += 1
            self._seconds[kind] = self._seconds.get(kind, 0.0) + max(0.0, seconds)
            self._replica_checks += 1 if replicas_checked else 0

    def record_mismatch(self, check: str, seconds: float) -> None:
        """Count a step stopped by a failing check (an incident was raised)."""
        with self._lock:
            self._mismatches[check] += 1
            self._seconds["stopped"] = self._seconds.get("stopped", 0.0) + max(0.0, seconds)

    def snapshot(self) -> dict[str, Any]:
        """The counts as plain data (no prometheus-client needed)."""
        with self._lock:
            return {
                "steps": dict(self._steps),
                "step_seconds": dict(self._seconds),
                "replica_checks": self._replica_checks,
                "mismatches": dict(self._mismatches),
            }

    # --- export (prometheus-client) ---------------------------------------------------------

    def registry(self) -> Any:
        """A prometheus-client registry holding this rank's series (made on first use)."""
        if self._registry is None:
            try:
                from prometheus_client import CollectorRegistry
            except ImportError as exc:
                raise ImportError(
                    "exporting training metrics needs prometheus-client: pip install 'replicheck[metrics]'"
                ) from exc
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            self._registry = registry
        return self._registry

    def exposition(self) -> bytes:
        """The Prometheus text format of this rank's series."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry()))

    def write_textfile(self, path: str | os.PathLike[str]) -> None:
        """Write the series atomically for node_exporter's textfile collector."""
        from prometheus_client import write_to_textfile

        write_to_textfile(str(path), self.registry())

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` for this rank on ``port`` (0: any free port) in a daemon thread;
        returns prometheus-client's (server, thread)."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry())


class _Collector:
    def __init__(self, metrics: TrainingMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        snap = self.metrics.snapshot()
        base = [self.metrics.job_id, str(self.metrics.rank)]
        steps = CounterMetricFamily(
            "replicheck_training_steps",
            "Guarded steps whose update was applied, by kind (plain, verified: ran the ring replay)",
            labels=["job", "rank", "kind"],
        )
        seconds = CounterMetricFamily(
            "replicheck_training_step_seconds",
            "Wall time in guarded steps, by kind (plain, verified, stopped)",
            labels=["job", "rank", "kind"],
        )
        for kind in ("plain", "verified"):
            steps.add_metric(base + [kind], snap["steps"].get(kind, 0))
        for kind in ("plain", "verified", "stopped"):
            seconds.add_metric(base + [kind], snap["step_seconds"].get(kind, 0.0))
        replicas = CounterMetricFamily(
            "replicheck_training_replica_checks",
            "Steps that compared weights and optimizer state across replicas",
            labels=["job", "rank"],
        )
        replicas.add_metric(base, snap["replica_checks"])
        mismatches = CounterMetricFamily(
            "replicheck_training_mismatches",
            "Steps stopped by a failing check (incidents), by the check that fired",
            labels=["job", "rank", "check"],
        )
        for check, count in sorted(snap["mismatches"].items()):
            mismatches.add_metric(base + [check], count)
        yield from (steps, seconds, replicas, mismatches)
