"""Helpers shared by the controller tests: incidents, a counting backend wrapper, a settable clock."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replicheck.controller import LocalBackend
from replicheck.controller.errors import PermanentBackendError, TransientBackendError
from replicheck.incident import Incident, NodeIdentity, Suspect, make_incident_id


def make_incident(
    *,
    job: str = "job1",
    step: int = 40,
    check: str = "replay",
    nodes: tuple[str, ...] = ("n2",),
    classification: str = "persistent",
    checkpoint_step: int | None = 30,
) -> Incident:
    """An incident naming ``nodes`` (as suspects, or as candidates when ambiguous)."""
    people = tuple(
        Suspect(rank=i, node=NodeIdentity(name=n, hostname=n, slurm_node=n)) for i, n in enumerate(nodes)
    )
    ambiguous = classification == "ambiguous"
    return Incident(
        id=make_incident_id(job, step, check),
        job_id=job,
        step=step,
        check=check,  # type: ignore[arg-type]
        suspect_ranks=() if ambiguous else tuple(range(len(nodes))),
        suspect_nodes=nodes,
        classification=classification,  # type: ignore[arg-type]
        suspects=() if ambiguous else people,
        candidates=people if ambiguous else (),
        recommended_checkpoint=None
        if checkpoint_step is None
        else {"step": checkpoint_step, "path": f"/ck/{checkpoint_step}"},
        world_size=4,
        last_verified_step=30,
    )


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


class Counting:
    """Wraps a backend, counting every call by method, and can fail chosen calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: Counter[str] = Counter()
        self.failures: dict[str, list[Exception]] = {}

    def fail(self, method: str, *errors: Exception) -> None:
        """The next len(errors) calls of ``method`` raise these errors, in order."""
        self.failures.setdefault(method, []).extend(errors)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        target = getattr(self.inner, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[method] += 1
            queue = self.failures.get(method)
            if queue:
                raise queue.pop(0)
            return target(*args, **kwargs)

        return call


def cluster(
    db: Path, active: tuple[str, ...] = ("n1", "n2", "n3"), spares: tuple[str, ...] = ("s1",)
) -> LocalBackend:
    backend = LocalBackend(db)
    for n in active:
        backend.add_node(n)
    for n in spares:
        backend.add_node(n, spare=True)
    # The incidents of these tests come from jobs running on the active nodes: register them, so
    # the allocation check passes (tests of forged incidents register their own jobs).
    for job in JOBS:
        backend.add_job(job, active)
    return backend


JOBS = ("job1", "job2", "train-7", "train-42", "f", "a")


__all__ = ["Clock", "Counting", "PermanentBackendError", "TransientBackendError", "cluster", "make_incident"]
