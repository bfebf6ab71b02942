"""The plain-language account of what a decision will do, as the page and the API show it."""

from __future__ import annotations

from pathlib import Path

from httpkit import cluster, make_incident

from replicheck.controller import Controller, ControllerConfig
from replicheck.controller.http.views import consequences


def _view(tmp_path: Path, **incident: object) -> tuple[Controller, str]:
    db = tmp_path / "c.db"
    cluster(db)
    ctl = Controller(db, config=ControllerConfig(apply=True))
    inc = make_incident(**incident)  # type: ignore[arg-type]
    ctl.ingest(inc)
    ctl.reconcile()
    return ctl, inc.id


def test_approve_and_dismiss_spelled_out(tmp_path: Path) -> None:
    """Approve names the nodes, the job, the checkpoint and the exclusion; dismiss names the
    cordon lifted and says the job is not resumed."""
    ctl, iid = _view(tmp_path)
    with ctl:
        text = consequences(ctl.show(iid), ControllerConfig(), applies=True)
    assert text["approve"].startswith("Node(s) n2 will be taken out of service and replaced")
    assert "job job1 is resumed from checkpoint step 30 (/ckpt/step-30), without n2" in text["approve"]
    assert "the cordon on n2 is lifted" in text["dismiss"] and "NOT resumed" in text["dismiss"]
    assert text["status"] == "A decision is needed."
    assert "dry-run" not in text["approve"] + text["dismiss"]


def test_dry_run_and_replacement_limit_are_said(tmp_path: Path) -> None:
    """A controller that does not apply, and a policy that will hold the replacement back, are
    both stated with the approval."""
    ctl, iid = _view(tmp_path, nodes=("n1", "n2"))
    with ctl:
        text = consequences(ctl.show(iid), ControllerConfig(max_replacements=1), applies=False)
    assert "needs 2 replacements but the policy allows 1 per 24 h; it will wait" in text["approve"]
    assert text["approve"].endswith("performs no cluster action.")
    assert text["dismiss"].endswith("performs no cluster action.")


def test_refused_status_says_nothing_was_done(tmp_path: Path) -> None:
    """A refused incident (a node outside its job's allocation) is stated as refused, with the
    reason, not as "no decision yet"."""
    ctl, iid = _view(tmp_path, job="ghost-job")  # a job the cluster does not know
    with ctl:
        text = consequences(ctl.show(iid), ControllerConfig(), applies=True)
    assert text["status"].startswith("Refused: nothing was done and nothing will be")
    assert "job ghost-job is not known to the backend" in text["status"]
