"""``replicheck incidents list | show ID | approve ID --by NAME | dismiss ID --by NAME | ingest FILE``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from replicheck.cli._support import add_actions, add_db_argument, add_json_argument

    sub = add_actions(subparsers, "incidents", help="list, inspect, approve or dismiss incidents")
    p = sub.add_parser("list", help="all incidents and their states")
    add_json_argument(p)
    p.add_argument("--rejected", action="store_true", help="list rejected inputs instead")
    p.set_defaults(func=_list)
    p = sub.add_parser("show", help="one incident with its actions and audit log")
    p.add_argument("id")
    add_json_argument(p)
    p.set_defaults(func=_show)
    for name, verb in (
        ("approve", "approve the replacement of"),
        ("dismiss", "dismiss (undo the cordon of)"),
    ):
        p = sub.add_parser(name, help=f"{verb} an incident's suspect nodes")
        p.add_argument("id")
        p.add_argument(
            "--by",
            required=True,
            metavar="NAME",
            help="who decides (recorded in the audit log with the OS account running this)",
        )
        p.set_defaults(func=_approve if name == "approve" else _dismiss)
    p = sub.add_parser("ingest", help="store incident files (the running controller acts on them)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=_ingest)
    for p in sub.choices.values():
        add_db_argument(p)


def _controller(args: argparse.Namespace, *, read_only: bool = False) -> Any:
    from replicheck.cli._support import db_path, existing_db_path
    from replicheck.controller import Controller

    return Controller(existing_db_path(args) if read_only else db_path(args))


def _list(args: argparse.Namespace) -> int:
    from replicheck.cli._render import RECORD_HEADER, record_line
    from replicheck.cli._support import esc, excerpt, print_json

    with _controller(args, read_only=True) as ctl:
        if args.rejected:
            rows = ctl.store.rejected_rows()
            if args.json:
                print_json(
                    [
                        {"source": s, "reason": r, "at": at, "bytes": len(c), "excerpt": excerpt(c)}
                        for s, r, c, at in rows
                    ]
                )
            for source, reason, _, at in [] if args.json else rows:
                print(f"{esc(at)} {esc(source)}: {esc(reason)}")
            return 0
        records = ctl.records()
        if args.json:
            print_json([dataclasses.asdict(r) | {"state": r.state.value} for r in records])
            return 0
        if records:
            print(RECORD_HEADER)
        else:
            print("no incidents", file=sys.stderr)
        for r in records:
            print(record_line(r))
        rejected = ctl.store.count("SELECT COUNT(*) FROM rejected")
        if rejected:
            print(
                f"({rejected} rejected input(s); see: replicheck incidents list --rejected)", file=sys.stderr
            )
        for table, key, reason, at in ctl.store.quarantined():
            print(esc(f"quarantined ({table}) {key}: {reason} (since {at})"), file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    from replicheck.cli._render import record_detail
    from replicheck.cli._support import esc, print_json

    with _controller(args, read_only=True) as ctl:
        view = ctl.show(args.id)
        if args.json:
            print_json(
                {
                    "incident": view.incident.incident.to_dict(),
                    "record": dataclasses.asdict(view.record) | {"state": view.record.state.value},
                    "deliveries": view.incident.deliveries,
                    "actions": [dataclasses.asdict(a) | {"kind": a.kind.value} for a in view.actions],
                    "audit": [dataclasses.asdict(a) for a in view.audit],
                }
            )
            return 0
        inc = view.incident.incident
        print(
            esc(
                f"incident {inc.id}  (step {inc.step}, check {inc.check}, {inc.time}, "
                f"{view.incident.deliveries} deliveries)"
            )
        )
        for line in record_detail(view.record):
            print("  " + line)
        print("  actions:")
        for a in view.actions:
            note = f" - {a.last_error}" if a.last_error and a.status != "done" else ""
            print(
                "    "
                + esc(f"{a.kind.value:<12} {a.node or '-':<12} {a.status:<10} attempts={a.attempts}{note}")
            )
        print("  audit:")
        for e in view.audit:
            print("    " + esc(f"{e.at} {e.actor}: {e.what} -> {e.outcome}"))
    return 0


def _approve(args: argparse.Namespace) -> int:
    from replicheck.cli._support import esc

    with _controller(args) as ctl:
        record = ctl.approve(args.id, by=args.by)
    print(esc(f"{record.incident_id}: {record.state.value} ({record.reason})"))
    return 0


def _dismiss(args: argparse.Namespace) -> int:
    from replicheck.cli._support import esc

    with _controller(args) as ctl:
        record = ctl.dismiss(args.id, by=args.by)
    print(esc(f"{record.incident_id}: {record.state.value} ({record.reason})"))
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from replicheck.cli._support import ingest_files

    with _controller(args) as ctl:
        return ingest_files(ctl, args.files)
