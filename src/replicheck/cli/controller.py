"""``replicheck controller run``: the reconcile loop (never imports torch)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

from replicheck.controller.wiring import BACKENDS


def register(subparsers: Any) -> None:
    from replicheck.cli._support import add_actions, add_db_argument, add_slurm_conf_argument

    sub = add_actions(subparsers, "controller", help="run the recovery controller")
    run = sub.add_parser("run", help="ingest incidents and drive them through the recovery procedure")
    add_db_argument(run)
    run.add_argument("--config", metavar="FILE", help="TOML file with [controller] and [slurm] tables")
    run.add_argument("--backend", choices=BACKENDS, help="cluster backend (default: local)")
    run.add_argument(
        "--watch", action="append", default=[], metavar="DIR", help="incident directory to watch (repeatable)"
    )
    run.add_argument(
        "--checkpoint-root",
        action="append",
        default=[],
        metavar="DIR",
        help="directory a job may be resumed from ({job_id} allowed; repeatable; adds to the config's "
        "checkpoint_roots). Without one, an incident naming a checkpoint is not resumed",
    )
    run.add_argument(
        "--incident",
        action="append",
        default=[],
        metavar="FILE",
        help="incident file to ingest before starting (repeatable)",
    )
    run.add_argument(
        "--apply", action="store_true", default=None, help="perform destructive actions (default: dry-run)"
    )
    run.add_argument(
        "--auto-approve",
        action="store_true",
        default=None,
        help="replace without waiting for a person's approval",
    )
    run.add_argument("--once", action="store_true", help="one reconcile pass, then exit")
    run.add_argument("--passes", type=int, default=None, help="stop after this many passes")
    run.add_argument("--interval", type=float, default=None, metavar="S", help="seconds between passes")
    add_slurm_conf_argument(run)
    run.add_argument(
        "--http",
        default=None,
        metavar="HOST:PORT",
        help="also serve the HTTP API, approval page and /metrics (pip install 'replicheck[http]')",
    )
    _add_http_options(run)
    run.set_defaults(func=_run)
    serve = sub.add_parser(
        "serve",
        help="serve the HTTP API, approval page and /metrics over a database, "
        "without acting (a running controller, or the demo, acts)",
    )
    add_db_argument(serve)
    serve.add_argument(
        "--http",
        default="127.0.0.1:8765",
        metavar="HOST:PORT",
        help="where to listen (default: 127.0.0.1:8765; port 0 picks a free one)",
    )
    serve.add_argument(
        "--config", metavar="FILE", help="TOML file whose [controller] policy the page explains"
    )
    _add_http_options(serve)
    serve.set_defaults(func=serve_database)


def _add_http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--job-token-file",
        default=None,
        metavar="FILE",
        help="file or directory with the token(s) jobs post incidents with, each scoped to its "
        "job(s) with jobs=PATTERN; re-read when it changes (default: $REPLICHECK_JOB_TOKEN_FILE)",
    )
    parser.add_argument(
        "--operator-token-file",
        default=None,
        metavar="FILE",
        help="file with the operator token(s) for reading and deciding "
        "(default: $REPLICHECK_OPERATOR_TOKEN_FILE); one 'TOKEN' or 'NAME TOKEN' per line",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="refuse larger request bodies with 413 (default: 1 MiB)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="client connections open at once (default 256, at most (descriptor limit - 192) / 2); "
        "an idle one is closed to make room",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        metavar="S",
        help="close a connection that has not sent its request headers within S seconds (default 10)",
    )
    parser.add_argument(
        "--requests-per-minute",
        type=int,
        default=None,
        metavar="N",
        help="requests one token may make a minute, else 429 (default 600; 0: no limit)",
    )
    parser.add_argument(
        "--incidents-per-day",
        type=int,
        default=None,
        metavar="N",
        help="new incidents one job token may store in 24 h, else 429 (default 1000; 0: no quota)",
    )
    parser.add_argument(
        "--trusted-proxy",
        default=None,
        metavar="ADDR[,ADDR...]",
        help="reverse proxies whose X-Forwarded-For is believed (default: none; the peer address is recorded)",
    )


def _run(args: argparse.Namespace) -> int:
    from replicheck.cli._support import db_path, esc, ingest_files, slurm_conf
    from replicheck.controller import Controller
    from replicheck.controller.wiring import (
        load_settings,
        make_backend,
        settings_to_json,
    )

    settings = load_settings(
        args.config,
        backend=args.backend,
        apply=args.apply,
        auto_approve=args.auto_approve,
        poll_interval_s=args.interval,
        slurm_overrides={"slurm_conf": slurm_conf(args)},
    )
    config = settings.controller
    from replicheck.controller.errors import ConfigError

    for directory in args.watch:
        if not os.path.isdir(directory):
            raise ConfigError(f"--watch {directory}: no such directory")
    for path in args.incident:
        if not os.path.isfile(path):
            raise ConfigError(f"--incident {path}: no such file")
    if args.watch:
        config = config.with_overrides(incident_dirs=tuple(config.incident_dirs) + tuple(args.watch))
    if args.checkpoint_root:
        roots = tuple(config.checkpoint_roots) + tuple(args.checkpoint_root)
        config = config.with_overrides(checkpoint_roots=roots)  # ConfigError for a relative path
    db = db_path(args)
    from replicheck.controller.lease import Lease

    # The lease comes before any write (migrations, the local backend's tables, the settings):
    # a second controller on this database changes nothing before it is refused.
    lease = Lease(db)
    lease.acquire()
    backend = make_backend(settings, db)

    failed: list[str] = []

    def show(t: Any) -> None:
        if t.to_state.value == "failed":
            failed.append(t.incident_id)
        print(
            esc(f"{t.at} {t.incident_id}: {t.from_state.value} -> {t.to_state.value} ({t.reason})"),
            flush=True,
        )

    with Controller(db, backend=backend, config=config, on_transition=show, lease=lease) as ctl:
        with ctl.store.transaction():
            ctl.store.set_meta("settings", settings_to_json(settings))
        status = ingest_files(ctl, args.incident)
        if not config.apply:
            print("dry-run: destructive actions are not performed (pass --apply to act)", flush=True)
        else:
            _release_dry_run(ctl)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        max_passes = 1 if args.once else args.passes
        if args.http is None:
            ctl.run(stop, max_passes=max_passes)
            return _outcome(ctl, status, failed)
        wake = threading.Event()  # set by the API after an incident is posted or decided

        def halt(*_: object) -> None:
            stop.set()
            wake.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, halt)
        server = _start_http(
            args, db, config, applies=config.apply, on_change=wake.set, liveness=ctl.liveness
        )
        try:
            ctl.run(stop, max_passes=max_passes, wake=wake)
        finally:
            server.stop()
        return _outcome(ctl, status, failed)


EXIT_FAILED = 1
"""``controller run`` exit status when an incident ended ``failed`` during the run."""


def _release_dry_run(ctl: Any) -> None:
    """Actions a dry run put off are due now that ``--apply`` is given (not after the dry run's
    poll interval), so ``run --apply --once`` right after a dry run acts."""
    from replicheck.controller.executor import DRY_RUN_NOTE
    from replicheck.timefmt import utc_iso_us

    now = utc_iso_us()
    with ctl.store.transaction():
        for row in ctl.store.actions():
            if row.status == "pending" and row.last_error == DRY_RUN_NOTE and row.next_attempt_at > now:
                ctl.store.defer_action(row.key, "released: --apply given", now)


def _outcome(ctl: Any, status: int, failed: list[str]) -> int:
    """Say what is still waiting (and until when), and exit non-zero when something failed."""
    from replicheck.cli._support import esc
    from replicheck.timefmt import utc_iso_us

    now = utc_iso_us()
    for row in ctl.store.actions():
        if row.status == "pending" and row.next_attempt_at > now:
            node = f" {row.node}" if row.node else ""
            print(
                esc(
                    f"deferred: {row.incident_id} {row.kind.value}{node} until {row.next_attempt_at}"
                    f" ({row.last_error or 'not yet due'})"
                ),
                flush=True,
            )
    if failed:
        print(esc(f"failed: {', '.join(failed)} (see: replicheck incidents show ID)"), flush=True)
        return max(status, EXIT_FAILED)
    return status


def serve_database(args: argparse.Namespace) -> int:
    """Serve the HTTP API and page over an existing database until SIGTERM/SIGINT (no acting)."""
    from pathlib import Path

    from replicheck.cli._support import db_path
    from replicheck.controller.errors import ConfigError
    from replicheck.controller.wiring import load_settings

    db = db_path(args)
    if not Path(db).is_file():
        raise ConfigError(
            f"no controller database at {db} (run 'make demo' or 'replicheck controller run' first)"
        )
    config = load_settings(args.config).controller
    server = _start_http(args, db, config, applies=None, on_change=None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.stop()
    return 0


def _start_http(
    args: argparse.Namespace,
    db: str,
    config: Any,
    *,
    applies: bool | None,
    on_change: Any,
    liveness: Any = None,
) -> Any:
    """Build the app from the token files and start it; prints where it listens."""
    from replicheck.controller.errors import ConfigError

    try:
        from replicheck.controller.http import (
            BackgroundServer,
            HttpConfig,
            Role,
            ServerLimits,
            create_app,
            parse_address,
            read_token_file,
        )
    except ImportError as exc:
        raise ConfigError(str(exc)) from exc
    host, port = parse_address(args.http)
    tokens: list[Any] = []
    job_file = args.job_token_file or os.environ.get("REPLICHECK_JOB_TOKEN_FILE")
    operator_file = args.operator_token_file or os.environ.get("REPLICHECK_OPERATOR_TOKEN_FILE")
    if not operator_file:
        raise ConfigError("--http needs --operator-token-file FILE (or $REPLICHECK_OPERATOR_TOKEN_FILE)")
    tokens += read_token_file(operator_file, Role.OPERATOR)
    chosen = {
        "max_body_bytes": args.max_body_bytes,
        "requests_per_minute": args.requests_per_minute,
        "incidents_per_day": args.incidents_per_day,
    }
    options = {k: v for k, v in chosen.items() if v is not None}
    app = create_app(
        # The job tokens are re-read when their file (or directory) changes: jobs come and go.
        HttpConfig(
            db_path=db,
            tokens=tuple(tokens),
            job_token_path=job_file or None,
            controller=config,
            applies=applies,
            **options,
        ),
        on_change=on_change,
        liveness=liveness,
    )
    door = {"max_connections": args.max_connections, "header_timeout_s": args.header_timeout}
    limits = ServerLimits(
        **{k: v for k, v in door.items() if v is not None},
        trusted_proxies=tuple(p.strip() for p in (args.trusted_proxy or "").split(",") if p.strip()),
    )
    server = BackgroundServer(app, host, port, limits=limits).start()
    print(
        f"approval page: {server.url}/  (API: {server.url}/api/v1, description: {server.url}/openapi.json, "
        f"metrics: {server.url}/metrics)",
        flush=True,
    )
    if not job_file:
        print("no job token file: incidents cannot be posted over HTTP (--job-token-file)", flush=True)
    return server
