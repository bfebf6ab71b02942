"""Fixtures for controller tests."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from ctlkit import Clock, Counting, cluster

from replicheck.controller import Controller, ControllerConfig, LocalBackend


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def env(tmp_path: Path, clock: Clock) -> Iterator[Callable[..., tuple[Controller, Counting, LocalBackend]]]:
    """Factory: a controller over a fresh local cluster with a counting backend. Incidents
    ingested through it count as delivered by a credential scoped to their job (the tests of
    unvouched incidents pass ``vouched_by=""``)."""
    made: list[Controller] = []

    def build(**config: Any) -> tuple[Controller, Counting, LocalBackend]:
        db = tmp_path / "ctl.db"
        local = cluster(db, **config.pop("cluster", {}))
        counting = Counting(local)
        defaults: Mapping[str, Any] = {
            "apply": True,
            "retry_base_delay_s": 1.0,
            "retry_max_attempts": 3,
            "checkpoint_roots": ("/ck",),
        }
        ctl = Controller(db, backend=counting, config=ControllerConfig(**{**defaults, **config}), clock=clock)
        ctl.ingest = functools.partial(ctl.ingest, vouched_by="job token test (jobs=*)")  # type: ignore[method-assign]
        made.append(ctl)
        return ctl, counting, local

    yield build
    for ctl in made:
        ctl.close()
