"""The incident record: round trip, validation, atomic writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replicheck.incident import (
    Incident,
    IncidentFormatError,
    NodeIdentity,
    Suspect,
    read_incident,
    write_incident,
)

pytestmark = pytest.mark.timeout(30)


def sample() -> Incident:
    return Incident(
        id="job1-s30-replay",
        job_id="job1",
        step=30,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=("node0",),
        classification="persistent",
        suspects=(Suspect(rank=1, node=NodeIdentity(name="node0", slurm_node="node0")),),
        evidence={"pairs": [{"source": 1, "verifier": 2, "agree": False}]},
        last_verified_step=20,
        world_size=4,
        checks_failed=("replay",),
    )


def test_round_trip_through_json(tmp_path: Path) -> None:
    """An incident written to a directory reads back equal."""
    inc = sample()
    path = write_incident(inc, tmp_path)
    assert path.name == "job1-s30-replay.json"
    back = read_incident(path)
    assert back == inc
    assert not list(tmp_path.glob(".incident-*")), "no temporary file left behind"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version=99), "unsupported incident version"),
        (lambda d: d.update(schema="other"), "not a replicheck incident"),
        (lambda d: d.update(step=-1), "'step'"),
        (lambda d: d.update(check="vibes"), "'check'"),
        (lambda d: d.update(time="2026-12-02T10:00:00"), "UTC offset"),
        (lambda d: d.update(suspects=[{"rank": 1}]), "'node'"),
        (lambda d: d.pop("job_id"), "'job_id'"),
    ],
)
def test_malformed_records_are_rejected_clearly(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    """Each kind of malformed record raises IncidentFormatError naming the problem."""
    data = sample().to_dict()
    mutate(data)
    with pytest.raises(IncidentFormatError, match=message):
        Incident.from_json(json.dumps(data))


def test_not_json_is_rejected_with_path(tmp_path: Path) -> None:
    """A file that is not JSON is refused with its path in the message."""
    bad = tmp_path / "x.json"
    bad.write_text("{nope")
    with pytest.raises(IncidentFormatError, match="x.json"):
        read_incident(bad)
