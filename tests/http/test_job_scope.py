"""Job-scoped tokens over HTTP (issue 27): a job's token speaks only for its own job, its
incidents are vouched for (auto-approve may act), and a token whose file is removed at job end
stops working without a restart."""

from __future__ import annotations

from pathlib import Path

from httpkit import ALICE_TOKEN, call, cluster, make_incident, write_tokens

from replicheck.controller import Controller, ControllerConfig
from replicheck.controller.http import BackgroundServer, HttpConfig, Role, create_app, read_token_file

INCIDENTS = "/api/v1/incidents"
TOKEN_A = "job-a-token-0123456789abcdef"


def test_scoped_job_token_is_refused_for_another_job_and_loses_its_power_at_job_end(tmp_path: Path) -> None:
    """A token scoped to job1 posts job1's incident (201, vouched); the same token posting for
    job2 is refused 403 (audited, nothing stored); after its file is removed (job end) it is 401."""
    db = tmp_path / "ctl.db"
    cluster(db)
    _, operator = write_tokens(tmp_path)
    tokens_dir = tmp_path / "job-tokens"
    tokens_dir.mkdir()
    (tokens_dir / "job1").write_text(f"slurm-job1 {TOKEN_A} jobs=job1\n")
    (tokens_dir / "job1").chmod(0o600)
    app = create_app(
        HttpConfig(
            db_path=str(db), tokens=read_token_file(operator, Role.OPERATOR), job_token_path=str(tokens_dir)
        )
    )
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        mine = make_incident(job="job1", nodes=("n2",))
        assert call(server.url, "POST", INCIDENTS, mine.to_json(), token=TOKEN_A).status == 201
        other = make_incident(job="job2", step=41, nodes=("n3",))
        refused = call(server.url, "POST", INCIDENTS, other.to_json(), token=TOKEN_A)
        assert refused.status == 403 and "not for job job2" in refused.json()["error"]["message"]
        with Controller(db, config=ControllerConfig()) as ctl:
            assert [r.incident_id for r in ctl.records()] == [mine.id]
            assert ctl.store.get_record(mine.id).vouched_by == "job token slurm-job1 (jobs=job1)"
            assert any("not for job job2" in a.outcome for a in ctl.store.audit_rows())
        (tokens_dir / "job1").unlink()  # the epilog removes the job's token at job end
        gone = call(server.url, "POST", INCIDENTS, mine.to_json(), token=TOKEN_A)
        assert gone.status == 401
        assert call(server.url, "GET", "/api/v1/whoami", token=ALICE_TOKEN).status == 200
