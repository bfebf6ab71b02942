"""Fixtures for the HTTP tests: a controller database with a local cluster, token files, and
the API served by uvicorn on 127.0.0.1 with a free port, in a background thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from httpkit import Live, cluster, write_tokens

from replicheck.controller.http import BackgroundServer, HttpConfig, Role, create_app, read_token_file


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Live]]:
    """Factory: start the API (keyword arguments go to HttpConfig); stopped after the test."""
    servers: list[BackgroundServer] = []

    def start(**options: Any) -> Live:
        db = tmp_path / "ctl.db"
        if not db.exists():
            cluster(db)
        job, operator = write_tokens(tmp_path)
        tokens = read_token_file(job, Role.JOB) + read_token_file(operator, Role.OPERATOR)
        app = create_app(HttpConfig(db_path=str(db), tokens=tokens, **options))
        server = BackgroundServer(app, "127.0.0.1", 0).start()
        servers.append(server)
        return Live(server.url, db, job, operator)

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def live(serve: Callable[..., Live]) -> Live:
    return serve()
