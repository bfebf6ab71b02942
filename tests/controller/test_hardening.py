"""Controller hardening (issue 13): hostile files, node names, symlinks, unreadable files,
cancelled actions, blast radius for cordons, approval identity, strict and escaped output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ctlkit import PermanentBackendError, cluster, make_incident
from test_cli import cli

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.errors import ConfigError
from replicheck.incident import Incident, NodeIdentity, Suspect, write_incident

pytestmark = pytest.mark.timeout(120)


def test_hostile_files_beside_a_valid_one(tmp_path: Path) -> None:
    """Deep JSON, deep evidence, a lone surrogate and a non-UTF-8 file name are rejected; the valid incident is ingested."""
    inbox = tmp_path / "in"
    inbox.mkdir()
    good = make_incident()
    data = good.to_dict()
    (inbox / "deep.json").write_bytes(b"[" * 1000 + b"]" * 1000)
    deep = json.dumps({**data, "id": "x-s1-replay"}).replace(
        '"evidence": {}', '"evidence": {"e": ' + "[" * 500 + "]" * 500 + "}"
    )
    (inbox / "evidence.json").write_text(deep)
    (inbox / "surrogate.json").write_text(json.dumps({**data, "id": "\ud800x"}))
    (inbox / os.fsdecode(b"bad\xff\x1b.json")).write_text("{}")
    write_incident(good, inbox)
    db = tmp_path / "c.db"
    cluster(db).close()
    with Controller(db, config=ControllerConfig(apply=True, incident_dirs=(str(inbox),))) as ctl:
        ctl.reconcile()
        ctl.reconcile()
        assert ctl.store.get_record(good.id).state is State.AWAITING_APPROVAL
        reasons = {Path(s).name: r for s, r, _, _ in ctl.store.rejected_rows()}
    assert set(reasons) == {"deep.json", "evidence.json", "surrogate.json", "bad\\xff\x1b.json"}
    assert "nested too deeply" in reasons["deep.json"] and "deeper than" in reasons["evidence.json"]
    assert "surrogate" in reasons["surrogate.json"]


@pytest.mark.parametrize("name", ["n1:cordon", "n1 state=idle", "-h", "node[1-2]", "n\u0661"])
def test_hostile_node_name_is_rejected_at_ingest(env, name: str) -> None:  # type: ignore[no-untyped-def]
    """A node name outside the grammar (':' included) is rejected at ingest, through the API too, and nothing runs."""
    ctl, backend, _ = env()
    people = (Suspect(0, NodeIdentity(name=name)),)
    inc = Incident(
        id="j-s1-replay",
        job_id="j",
        step=1,
        check="replay",
        suspect_ranks=(0,),
        suspect_nodes=(name,),
        classification="persistent",
        suspects=people,
        world_size=2,
    )
    result = ctl.ingest(inc)
    assert result.incident_id is None and "node name" in (result.rejected or "")
    ctl.reconcile()
    assert ctl.records() == [] and sum(backend.calls.values()) == 0


def test_symlinks_are_not_followed_and_rejections_are_excerpts(tmp_path: Path) -> None:
    """A symlinked incident file is rejected unread; `incidents list --rejected --json` shows only short escaped excerpts."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET " * 100)
    inbox = tmp_path / "in"
    inbox.mkdir()
    (inbox / "leak.json").symlink_to(secret)
    (inbox / "big.json").write_text("\x1b[2J" + "A" * 5000)
    db = tmp_path / "c.db"
    with Controller(db, config=ControllerConfig(incident_dirs=(str(inbox),))) as ctl:
        ctl.reconcile()
    listing = cli("incidents", "list", "--rejected", "--json", "--db", str(db))
    assert listing.returncode == 0, listing.stderr
    rows = {Path(r["source"]).name: r for r in json.loads(listing.stdout)}
    assert rows["leak.json"]["reason"] == "symbolic link: not followed" and rows["leak.json"]["bytes"] == 0
    assert "TOP-SECRET" not in listing.stdout
    assert rows["big.json"]["excerpt"].startswith("\\x1b[2JAAA") and len(rows["big.json"]["excerpt"]) < 260
    assert "\x1b" not in listing.stdout


def test_unreadable_file_is_retried_until_read(tmp_path: Path) -> None:
    """A file the controller cannot read is reported and read again on each pass; after chmod it is ingested."""
    inbox = tmp_path / "in"
    inc = make_incident()
    path = write_incident(inc, inbox)
    path.chmod(0o000)
    db = tmp_path / "c.db"
    code = (
        "import sys\nfrom replicheck.controller import Controller, ControllerConfig\n"
        "with Controller(sys.argv[1], config=ControllerConfig(incident_dirs=(sys.argv[2],))) as c:\n"
        "    r = c.ingest_dir(sys.argv[2]); print(r[0].incident_id, '|', r[0].rejected)\n"
    )
    # Root reads any file: when the test runs as root the controller runs without that capability.
    drop = (
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
        if os.geteuid() == 0
        else []
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}

    def ingest() -> str:
        run = subprocess.run(
            [*drop, sys.executable, "-c", code, str(db), str(inbox)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert ingest() == "None | cannot read: Permission denied"
    assert ingest() == "None | cannot read: Permission denied"  # not marked seen: tried again
    path.chmod(0o644)
    assert ingest().startswith(f"{inc.id} |")
    with Controller(db) as ctl:
        assert ctl.store.get_record(inc.id).state is State.DETECTED
        assert ctl.store.rejected_rows() == []  # the "cannot read" report is cleared once read


def test_cancelled_replacement_does_not_run_in_the_same_pass(env) -> None:  # type: ignore[no-untyped-def]
    """When one replacement fails permanently, the incident's other replacement is cancelled and never performed."""
    ctl, backend, local = env(auto_approve=True, max_replacements=5, cluster={"spares": ("s1", "s2")})
    inc = make_incident(nodes=("n1", "n2"))
    ctl.ingest(inc)
    backend.fail("replace", PermanentBackendError("hardware vendor API refused"))
    ctl.reconcile()
    record = ctl.store.get_record(inc.id)
    assert record.state is State.FAILED and "refused" in record.reason
    assert backend.calls["replace"] == 1 and local.op_counts().get("replace", 0) == 0
    assert {a.node: a.status for a in ctl.store.actions(inc.id) if a.kind.value == "replace"} == {
        "n1": "failed",
        "n2": "cancelled",
    }


def test_cordons_are_bounded_per_incident(env) -> None:  # type: ignore[no-untyped-def]
    """An incident naming more nodes than max_cordons_per_incident cordons none and fails for a person."""
    names = tuple(f"m{i}" for i in range(6))
    ctl, backend, _ = env(max_cordons_per_incident=4, cluster={"active": names + ("n1",)})
    inc = make_incident(nodes=names)
    inc = Incident(**{**inc.__dict__, "world_size": 8})
    ctl.ingest(inc)
    ctl.reconcile()
    record = ctl.store.get_record(inc.id)
    assert record.state is State.FAILED and "max_cordons_per_incident=4" in record.reason
    assert backend.calls["cordon"] == 0


def test_cordons_are_bounded_per_window(env, clock) -> None:  # type: ignore[no-untyped-def]
    """Cordons over all incidents stop at max_cordons in the window; the next incident waits, saying so."""
    ctl, backend, _ = env(max_cordons=2, cluster={"active": ("n1", "n2", "n3", "n4")})
    first, second = make_incident(nodes=("n1", "n2")), make_incident(job="job2", nodes=("n3",))
    ctl.ingest(first)
    ctl.ingest(second)
    ctl.reconcile()
    assert backend.calls["cordon"] == 2
    record = ctl.store.get_record(second.id)
    assert record.state is State.DETECTED and "blast radius" in record.reason
    clock.advance(86401)
    ctl.reconcile()
    assert backend.calls["cordon"] == 3


def test_suspects_beyond_world_size_are_rejected(env) -> None:  # type: ignore[no-untyped-def]
    """An incident naming more nodes than its world size, or a rank beyond it, is never acted on."""
    ctl, _, _ = env()
    many = make_incident(nodes=tuple(f"m{i}" for i in range(5)))  # world_size 4
    assert "world_size" in (ctl.ingest(many).rejected or "")
    inc = make_incident()
    bad_rank = Incident(**{**inc.__dict__, "suspect_ranks": (9,)})
    assert "not below world_size" in (ctl.ingest(bad_rank).rejected or "")


@pytest.mark.parametrize(
    "by", ["alice\napproved by mallory", "controller", "auto-approve", "-x", "a\tb", "alice\u202e", "a\rb"]
)
def test_forged_or_reserved_approver_names_are_refused(env, by: str) -> None:  # type: ignore[no-untyped-def]
    """--by with a newline, tab, control or non-ASCII character, an option-like or a reserved name is refused."""
    ctl, _, _ = env()
    inc = make_incident()
    ctl.ingest(inc)
    ctl.reconcile()
    with pytest.raises(ConfigError):
        ctl.approve(inc.id, by=by)
    assert ctl.store.get_record(inc.id).state is State.AWAITING_APPROVAL


def test_approval_records_the_os_account(env) -> None:  # type: ignore[no-untyped-def]
    """An approval records the OS account (name and uid) that ran it, beside the --by name."""
    import pwd

    ctl, _, _ = env()
    inc = make_incident()
    ctl.ingest(inc)
    ctl.reconcile()
    record = ctl.approve(inc.id, by="alice")
    account = f"{pwd.getpwuid(os.getuid()).pw_name} uid {os.getuid()}"
    assert record.reason == f"approved by alice (os user {account})"
    assert any(a.actor == "alice" and account in a.outcome for a in ctl.store.audit_rows(inc.id))


def test_output_is_strict_json_and_escaped(tmp_path: Path) -> None:
    """NaN evidence comes back as strict JSON from `incidents show --json`; control characters are escaped in text."""
    db = tmp_path / "c.db"
    cluster(db).close()
    inbox = tmp_path / "in"
    inbox.mkdir()
    inc = make_incident()
    text = inc.to_json().replace('"evidence": {}', '"evidence": {"loss": NaN, "note": "a\\r\\u001b[31mb"}')
    (inbox / "nan.json").write_text(text)
    (inbox / "x\r\x1b[31m.json").write_text("{")
    with Controller(db, config=ControllerConfig(incident_dirs=(str(inbox),))) as ctl:
        ctl.reconcile()
    show = cli("incidents", "show", inc.id, "--json", "--db", str(db))
    assert show.returncode == 0, show.stderr
    data = json.loads(show.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert data["incident"]["evidence"]["loss"] == "NaN"
    listing = cli("incidents", "list", "--rejected", "--db", str(db))
    assert (
        "x\\x0d\\x1b[31m.json" in listing.stdout
        and "\r" not in listing.stdout
        and "\x1b" not in listing.stdout
    )
