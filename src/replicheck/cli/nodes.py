"""``replicheck nodes``: the cluster's nodes as the controller's backend sees them."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from replicheck.controller.wiring import BACKENDS


def register(subparsers: Any) -> None:
    from replicheck.cli._support import add_db_argument

    parser = subparsers.add_parser("nodes", help="list the nodes of the controller's cluster backend")
    add_db_argument(parser)
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="backend (default: the one `controller run` last used with this database)",
    )
    parser.add_argument(
        "--slurm-conf", default=None, metavar="PATH", help="slurm.conf (default: $SLURM_CONF)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_nodes)


def _nodes(args: argparse.Namespace) -> int:
    from replicheck.cli._render import node_line
    from replicheck.cli._support import db_path, print_json
    from replicheck.controller.store import Store
    from replicheck.controller.wiring import make_backend, settings_from_json

    db = db_path(args)
    store = Store(db)
    try:
        settings = settings_from_json(store.get_meta("settings"))
    finally:
        store.close()
    slurm = dict(settings.slurm)
    conf = args.slurm_conf or os.environ.get("SLURM_CONF")
    if conf:
        slurm["slurm_conf"] = conf
    # Keep the other backends' tables ([kubernetes], [hyperpod]) that `controller run` stored.
    settings = dataclasses.replace(settings, backend=args.backend or settings.backend, slurm=slurm)
    nodes = make_backend(settings, db).list_nodes()
    if args.json:
        print_json([dataclasses.asdict(n) for n in nodes])
        return 0
    for n in nodes:
        print(node_line(n))
    return 0
