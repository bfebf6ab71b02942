"""``replicheck nodes [list] | nodes add NAME... [--job JOB_ID]``: the cluster's nodes as the
controller's backend sees them, and declaring the nodes (and jobs) of the ``local`` (simulated)
backend."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from replicheck.controller.wiring import BACKENDS


def _list_options(parser: argparse.ArgumentParser, *, leaf: bool) -> None:
    """The listing options, on ``nodes`` itself and on ``nodes list``. On the leaf their default
    is SUPPRESS, so ``nodes --db X list`` keeps X (a subparser's defaults would overwrite it)."""
    from replicheck.cli._support import add_db_argument, add_json_argument, add_slurm_conf_argument

    keep = argparse.SUPPRESS if leaf else None
    add_db_argument(parser, default=keep)
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=keep,
        help="backend (default: the one `controller run` last used with this database)",
    )
    add_slurm_conf_argument(parser, default=keep)
    add_json_argument(parser, default=argparse.SUPPRESS if leaf else False)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "nodes", help="list the cluster's nodes; declare the nodes of the local backend"
    )
    _list_options(parser, leaf=False)
    parser.set_defaults(func=_nodes)
    sub = parser.add_subparsers(dest="nodes_command", metavar="ACTION")
    p = sub.add_parser("list", help="the nodes and their states (the default action)")
    _list_options(p, leaf=True)
    p.set_defaults(func=_nodes)
    p = sub.add_parser(
        "add",
        help="declare nodes of the local (simulated) backend; creates the database if needed",
    )
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--partition", default="main", help="partition of the nodes (default: main)")
    p.add_argument("--spare", action="store_true", help="spare nodes, swapped in by a replacement")
    p.add_argument(
        "--job",
        metavar="JOB_ID",
        default=None,
        help="a job runs on exactly these nodes (its allocation, which every incident of the job is "
        "checked against; declaring the job again replaces its nodes)",
    )
    p.add_argument(
        "--db", metavar="PATH", default=argparse.SUPPRESS, help="controller database (default: as for nodes)"
    )
    p.set_defaults(func=_add)


def _add(args: argparse.Namespace) -> int:
    from replicheck.cli._support import db_path, esc
    from replicheck.controller.backends.base import validate_node_name
    from replicheck.controller.backends.local import LocalBackend
    from replicheck.controller.store import Store
    from replicheck.controller.wiring import settings_from_json

    for name in args.names:  # all or nothing: a bad name adds none
        validate_node_name(name)
    if args.job is not None:
        from replicheck.controller.errors import ConfigError
        from replicheck.incident import JOB_ID

        if JOB_ID.fullmatch(args.job) is None:
            raise ConfigError(f"--job {args.job[:80]!r}: not a job id (letters, digits, ._+-, one '/')")
        if args.spare:
            raise ConfigError("--job names the nodes a job runs on; spares run none")
    db = db_path(args)
    store = Store(db)
    try:
        backend = settings_from_json(store.get_meta("settings")).backend
    finally:
        store.close()
    if backend != "local":
        from replicheck.controller.errors import ConfigError

        raise ConfigError(
            f"{db} drives the {backend} backend; only the local backend's nodes are declared here"
        )
    local = LocalBackend(db)
    try:
        known = {n.name for n in local.list_nodes()}
        for name in args.names:
            local.add_node(name, partition=args.partition, spare=args.spare)
            role = "spare" if args.spare else "active"
            note = "" if name not in known else " (already declared, left as is)"
            print(esc(f"{name}: {role} in partition {args.partition}{note}"))
        if args.job is not None:
            local.add_job(args.job, args.names)
            print(esc(f"job {args.job}: runs on {', '.join(args.names)}"))
    finally:
        local.close()
    return 0


def _nodes(args: argparse.Namespace) -> int:
    from replicheck.cli._render import NODE_HEADER, node_line
    from replicheck.cli._support import existing_db_path, print_json, slurm_conf
    from replicheck.controller.store import Store
    from replicheck.controller.wiring import make_backend, settings_from_json

    db = existing_db_path(args)
    store = Store(db)
    try:
        settings = settings_from_json(store.get_meta("settings"))
    finally:
        store.close()
    slurm = dict(settings.slurm)
    conf = slurm_conf(args)
    if conf:
        slurm["slurm_conf"] = conf
    # Keep the other backends' tables ([kubernetes], [hyperpod]) that `controller run` stored.
    settings = dataclasses.replace(settings, backend=args.backend or settings.backend, slurm=slurm)
    nodes = make_backend(settings, db).list_nodes()
    if args.json:
        print_json([dataclasses.asdict(n) for n in nodes])
        return 0
    if not nodes:
        hint = " (declare them: replicheck nodes add NAME...)" if settings.backend == "local" else ""
        print(f"no nodes in the {settings.backend} backend{hint}", file=sys.stderr)
        return 0
    print(NODE_HEADER)
    for n in nodes:
        print(node_line(n))
    return 0
