"""``replicheck audit verify``: check the controller's hash-chained audit log."""

from __future__ import annotations

import argparse
from typing import Any

EXIT_TAMPERED = 1


def register(subparsers: Any) -> None:
    from replicheck.cli._support import add_actions, add_db_argument, add_json_argument

    sub = add_actions(subparsers, "audit", help="verify the controller's audit log")
    p = sub.add_parser("verify", help="recompute the audit hash chain; exit 1 if any row was altered")
    add_db_argument(p)
    add_json_argument(p)
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from replicheck.cli._support import esc, existing_db_path, print_json
    from replicheck.controller.store import Store

    path = existing_db_path(args)
    store = Store(path)
    try:
        check = store.verify_audit()
    finally:
        store.close()
    if args.json:
        print_json({"ok": check.ok, "rows": check.rows, "head": check.head, "problems": list(check.problems)})
    elif check.ok:
        print(f"audit log intact: {check.rows} rows, head {check.head}")
    else:
        print(f"audit log TAMPERED: {len(check.problems)} problem(s) in {check.rows} rows")
        for problem in check.problems:
            print("  " + esc(problem))
    return 0 if check.ok else EXIT_TAMPERED
