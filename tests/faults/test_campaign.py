"""The campaign runner on a tiny job: a fast subset of the matrix, its table and its files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from replicheck.campaign.report import markdown
from replicheck.campaign.runner import controller_actions, run_campaign
from replicheck.campaign.scenarios import (
    JobDefaults,
    default_scenarios,
    fast_scenarios,
    select,
)
from replicheck.campaign.soak import soak_model
from replicheck.faults.errors import FaultConfigError


def _tiny(**kw: object) -> JobDefaults:
    return JobDefaults(model=soak_model(), batch=2, steps=31, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_fast_subset_detects_at_the_first_check_with_the_right_suspect() -> None:
    """Each fast-subset row behaves as documented: detected on time with the right suspect, the
    unverified one-shot fault missed, the clean run silent — and no false alarms anywhere."""
    outcomes = run_campaign(fast_scenarios(), _tiny())
    by = {o.name: o for o in outcomes}
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert all(o.as_expected for o in outcomes), {o.name: o.to_dict() for o in outcomes if not o.as_expected}
    aws = by["aws-persistent-3n"]
    assert (aws.detected_at, aws.suspect_ranks, aws.applied_corrupted, aws.classification) == (
        30,
        [1],
        [23, 29],
        "persistent",
    )
    red = by["reduced-gradient"]
    assert (red.detected_at, red.check, red.applied_corrupted) == (23, "reduced_gradients", None)
    assert by["transient-unverified"].detected_at is None and by["transient-unverified"].corruptions == 1
    assert by["clean"].verification_pairs == 4 * 4 and sum(o.false_alarms for o in outcomes) == 0


@pytest.mark.timeout(240)
def test_data_borne_and_refused_rows_hold_what_they_claim() -> None:
    """The data-borne row is caught on its step as ``data`` with no node named and no controller
    action; the refused rows are refused on every rank with the expected message, and a refusal
    that does not say what the row expects is not counted as expected."""
    rows = select(default_scenarios(), "data-borne-inf,syncbn-refused,static-graph-refused")
    wrong = dataclasses.replace(rows[-1], name="static-graph-wrong-text", refusal="no such advice")
    outcomes = {o.name: o for o in run_campaign([*rows, wrong], _tiny())}
    assert all(o.error is None for o in outcomes.values()), [o.error for o in outcomes.values()]
    data = outcomes["data-borne-inf"]
    assert data.as_expected and (data.detected_at, data.check, data.classification) == (
        23,
        "gradients",
        "data",
    )
    assert data.suspect_ranks == [] and data.false_alarms == 0
    assert data.incident is not None and controller_actions(data.incident) == []
    for name, text in (("syncbn-refused", "SyncBatchNorm"), ("static-graph-refused", "static_graph")):
        o = outcomes[name]
        assert o.as_expected and o.check == "refused at construction" and text in (o.refusal or "")
    assert not outcomes["static-graph-wrong-text"].as_expected
    table = markdown([o.to_dict() for o in outcomes.values()], {}, plots=False)
    assert "| refused at construction |" in table and "none named" in table


@pytest.mark.timeout(120)
def test_cli_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    """`replicheck campaign` writes results.json, results.md and one PNG per scenario."""
    from replicheck.cli import main

    pytest.importorskip("matplotlib")
    rc = main(
        [
            "campaign",
            "--scenarios",
            "reduced-gradient",
            "--tiny",
            "--steps",
            "26",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in data["scenarios"]] == ["reduced-gradient"]
    assert "| `reduced-gradient` |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "reduced-gradient.png").stat().st_size > 1000


@pytest.mark.timeout(30)
def test_markdown_without_plots_says_how_to_get_them() -> None:
    """Without matplotlib the table is still written and tells how to get the timelines."""
    row = {
        "name": "clean",
        "title": "Clean run",
        "fault": None,
        "nodes": 2,
        "gpus_per_node": 2,
        "mode": "exact",
        "verify_every": 10,
        "onset": None,
        "detected_at": None,
        "applied_corrupted": None,
        "check": None,
        "suspect_correct": None,
        "classification": None,
        "false_alarms": 0,
        "as_expected": True,
    }
    text = markdown([row], {"command": "replicheck campaign"}, plots=False)
    assert "| `clean` |" in text and "replicheck[plot]" in text and "15,320" in text


@pytest.mark.timeout(30)
def test_scenario_filter_matches_names_and_rejects_unknown() -> None:
    """--scenarios keeps the named rows (prefixes with *) and rejects names it does not know."""
    names = [s.name for s in select(default_scenarios(), "clean*,nan")]
    assert names == ["nan", "clean", "clean-tolerant"]
    with pytest.raises(FaultConfigError):
        select(default_scenarios(), "nope")
