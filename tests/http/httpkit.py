"""Helpers for the HTTP tests: incidents, token files, a live server on a free port, requests."""

from __future__ import annotations

import dataclasses
import datetime as dt
import http.client
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.controller import Controller, ControllerConfig, LocalBackend
from replicheck.incident import Incident, NodeIdentity, Suspect, make_incident_id

JOB_TOKEN = "job-token-0123456789abcdef"
ALICE_TOKEN = "alice-token-0123456789abcdef"
SHARED_TOKEN = "shared-operator-0123456789abcdef"


def make_incident(
    *,
    job: str = "job1",
    step: int = 40,
    nodes: tuple[str, ...] = ("n2",),
    classification: str = "persistent",
    time: str | None = None,
) -> Incident:
    """A replay incident naming ``nodes``, with pair evidence and a recommended checkpoint."""
    people = tuple(
        Suspect(rank=i + 1, node=NodeIdentity(name=n, hostname=f"{n}.cluster", slurm_node=n))
        for i, n in enumerate(nodes)
    )
    pairs = [
        {
            "source": 1,
            "verifier": 2,
            "source_node": nodes[0],
            "verifier_node": "n3",
            "distance": 0.25,
            "agree": False,
        },
        {
            "source": 0,
            "verifier": 1,
            "source_node": "n1",
            "verifier_node": nodes[0],
            "distance": 0.0,
            "agree": True,
        },
    ]
    incident = Incident(
        id=make_incident_id(job, step, "replay"),
        job_id=job,
        step=step,
        check="replay",
        suspect_ranks=tuple(s.rank for s in people),
        suspect_nodes=nodes,
        classification=classification,  # type: ignore[arg-type]
        suspects=people,
        evidence={"replay": {"pairs": pairs}},
        last_verified_step=30,
        recommended_checkpoint={"step": 30, "path": "/ckpt/step-30"},
        world_size=4,
    )
    return incident if time is None else dataclasses.replace(incident, time=time)


def cluster(db: Path) -> None:
    backend = LocalBackend(db)
    for n in ("n1", "n2", "n3"):
        backend.add_node(n)
    backend.add_node("s1", spare=True)
    for job in JOBS:  # the jobs these tests report on, for the allocation check
        backend.add_job(job, ("n1", "n2", "n3"))


JOBS = (
    ("job1", "job2", "a", "b", "train-7", "train-42")
    + tuple(f"race{n}" for n in range(8))
    + tuple(f"r{n}" for n in range(8))
)
"""The jobs of the HTTP tests, each running on n1-n3 (a test of another job registers it)."""


def write_tokens(directory: Path) -> tuple[Path, Path]:
    """A job token file and an operator token file (alice named, plus one shared token)."""
    job = directory / "job.token"
    job.write_text(JOB_TOKEN + "\n")
    operator = directory / "operator.tokens"
    operator.write_text(f"# operators\nalice {ALICE_TOKEN}\n{SHARED_TOKEN}\n")
    for p in (job, operator):
        p.chmod(0o600)
    return job, operator


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Live:
    """A running API over ``db``."""

    url: str
    db: Path
    job_token_file: Path
    operator_token_file: Path

    def controller(self, **config: Any) -> Controller:
        return Controller(
            self.db, config=ControllerConfig(**{"apply": True, "checkpoint_roots": ("/ckpt",), **config})
        )


def call(
    base: str,
    method: str,
    path: str,
    body: bytes | str | Mapping[str, Any] | None = None,
    *,
    token: str | None = None,
    content_type: str = "application/json",
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> Reply:
    """One request with http.client (which, unlike urllib, returns every status as a Reply)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, Mapping) else body
    if isinstance(data, str):
        data = data.encode()
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    if data is not None:
        hdrs.setdefault("Content-Type", content_type)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat(timespec="microseconds")
