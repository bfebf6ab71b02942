"""``replicheck controller run``: the reconcile loop (never imports torch)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("controller", help="run the recovery controller")
    sub = parser.add_subparsers(dest="controller_command", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="ingest incidents and drive them through the recovery procedure")
    from replicheck.cli._support import add_db_argument

    add_db_argument(run)
    run.add_argument("--config", metavar="FILE", help="TOML file with [controller] and [slurm] tables")
    run.add_argument("--backend", choices=("local", "slurm"), help="cluster backend (default: local)")
    run.add_argument("--watch", action="append", default=[], metavar="DIR",
                     help="incident directory to watch (repeatable)")
    run.add_argument("--incident", action="append", default=[], metavar="FILE",
                     help="incident file to ingest before starting (repeatable)")
    run.add_argument("--apply", action="store_true", default=None,
                     help="perform destructive actions (default: dry-run)")
    run.add_argument("--auto-approve", action="store_true", default=None,
                     help="replace without waiting for a person's approval")
    run.add_argument("--once", action="store_true", help="one reconcile pass, then exit")
    run.add_argument("--passes", type=int, default=None, help="stop after this many passes")
    run.add_argument("--interval", type=float, default=None, metavar="S", help="seconds between passes")
    run.add_argument("--slurm-conf", default=None, metavar="PATH", help="slurm.conf (default: $SLURM_CONF)")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from replicheck.cli._support import db_path, esc, ingest_files
    from replicheck.controller import Controller
    from replicheck.controller.wiring import (
        load_settings,
        make_backend,
        settings_to_json,
    )

    settings = load_settings(
        args.config, backend=args.backend, apply=args.apply, auto_approve=args.auto_approve,
        poll_interval_s=args.interval,
        slurm_overrides={"slurm_conf": args.slurm_conf or os.environ.get("SLURM_CONF")},
    )
    config = settings.controller
    if args.watch:
        config = config.with_overrides(incident_dirs=tuple(config.incident_dirs) + tuple(args.watch))
    db = db_path(args)
    backend = make_backend(settings, db)

    def show(t: Any) -> None:
        print(esc(f"{t.at} {t.incident_id}: {t.from_state.value} -> {t.to_state.value} ({t.reason})"), flush=True)

    with Controller(db, backend=backend, config=config, on_transition=show) as ctl:
        with ctl.store.transaction():
            ctl.store.set_meta("settings", settings_to_json(settings))
        status = ingest_files(ctl, args.incident)
        if not config.apply:
            print("dry-run: destructive actions are not performed (pass --apply to act)", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        ctl.run(stop, max_passes=1 if args.once else args.passes)
        return status
