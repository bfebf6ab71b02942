"""``replicheck demo``: the whole detection-to-recovery story on one machine."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="detect, cordon, triage, approve, replace and resume on a local cluster")
    p.add_argument("--scenario", default="aws-persistent-3n", help="campaign scenario to play")
    p.add_argument(
        "--out",
        default=None,
        help="output directory: new, empty, or an earlier demo's (a non-empty other directory is refused); "
        "default demo-out, or demo-out-no-restart with --no-restart",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training length (default 40; 60 with --no-restart)"
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="torchft replica groups: the faulty group leaves, training goes on, a spare joins live "
        "after approval; compared with today's checkpoint resume (needs replicheck[torchft])",
    )
    p.add_argument("--onset", type=int, default=23, help="--no-restart: the fault's first step")
    p.add_argument("--verify-every", type=int, default=10, help="--no-restart: the guard's replay period")
    p.add_argument("--yes", action="store_true", help="approve without asking (also when no terminal)")
    p.add_argument("--json", action="store_true", help="print the facts as JSON at the end")
    p.add_argument(
        "--serve",
        default=None,
        metavar="HOST:PORT",
        help="at the end, keep serving the approval page over the demo's controller database "
        "(e.g. 127.0.0.1:8765; needs replicheck[http]); Ctrl-C stops it",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from replicheck.demo import DemoConfig, run_demo

    def ask(prompt: str) -> bool:
        return input(prompt).strip().lower() in ("y", "yes")

    interactive = sys.stdin.isatty() and not args.yes
    if args.no_restart:
        return _no_restart(args, ask if interactive else None, interactive)
    args.out = args.out or "demo-out"
    cfg = DemoConfig(
        scenario=args.scenario,
        out_dir=args.out,
        steps=args.steps or 40,
        approve=ask if interactive else None,
        approver="operator" if interactive else "demo --yes",
    )
    from replicheck.demo import DemoError
    from replicheck.faults.errors import FaultConfigError

    try:
        facts = run_demo(cfg)
    except (DemoError, FaultConfigError) as exc:
        print(f"replicheck demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in facts.items() if k not in ("timeline", "losses")}, indent=2, default=str
            )
        )
    status = 1 if facts.get("detected") and facts.get("final_equal") is False else 0
    if args.serve:
        return _serve(args) or status
    return status


def _no_restart(args: argparse.Namespace, ask: Callable[[str], bool] | None, interactive: bool) -> int:
    from replicheck.demo import DemoError
    from replicheck.demo_no_restart import NoRestartConfig, run_no_restart_demo

    if args.serve:
        print("replicheck demo: error: --serve is not offered with --no-restart", file=sys.stderr)
        return 2
    cfg = NoRestartConfig(
        out_dir=args.out or "demo-out-no-restart",
        steps=args.steps or 60,
        onset=args.onset,
        verify_every=args.verify_every,
        approve=ask,
        approver="operator" if interactive else "demo --yes",
    )
    try:
        facts = run_no_restart_demo(cfg)
    except DemoError as exc:
        print(f"replicheck demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in facts.items() if k != "timeline"}, indent=2, default=str))
    return 0 if facts["ok"] else 1


def _serve(args: argparse.Namespace) -> int:
    """The approval page over the demo's database, with an operator token made for it."""
    import os
    import secrets
    from pathlib import Path

    from replicheck.cli.controller import serve_database

    token = Path(args.out) / "operator.token"
    if not token.exists():
        # Private from the start: the page's operator token is a secret.
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    print(f"operator token for the page: in {token}", flush=True)
    return serve_database(
        argparse.Namespace(
            db=str(Path(args.out) / "controller.db"),
            http=args.serve,
            config=None,
            job_token_file=None,
            operator_token_file=str(token),
            # The door's limits at their defaults (the flags `controller serve` takes).
            max_body_bytes=None,
            requests_per_minute=None,
            incidents_per_day=None,
            max_connections=None,
            header_timeout=None,
            trusted_proxy=None,
        )
    )
