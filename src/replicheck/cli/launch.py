"""``replicheck launch``: run a training command (torchrun, a script) so that a detection survives
the launcher: refuse a node an unresolved incident names (exit 86) and end with 87 when the
command failed and wrote a new incident, whatever status the launcher itself returned."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "launch",
        help="run a training command; refuse a suspect node, exit 87 on a detection",
        description="Refuse to start when an unresolved incident in --incident-dir names this node "
        "(exit 86); otherwise run COMMAND and, when it fails and a new incident file appeared, print "
        "the incident's summary and exit 87 (torchrun itself exits 1). Without COMMAND: only the check.",
    )
    p.add_argument("--incident-dir", required=True, metavar="DIR", help="the jobs' incident directory")
    p.add_argument(
        "--node",
        default=None,
        metavar="NAME",
        help="this node's name (default: REPLICHECK_NODE, SLURMD_NODENAME, NODE_NAME, host name)",
    )
    p.add_argument(
        "--controller-db",
        default=None,
        metavar="PATH",
        help="controller database (read-only) telling which incidents are resolved",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what to run")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    from replicheck.codes import EXIT_CORRUPTION, EXIT_SUSPECT_NODE
    from replicheck.elastic import SuspectNodeError, refuse_if_suspect, summary
    from replicheck.incident import IncidentFormatError, read_incident

    node = args.node or _node_from_env()
    try:
        refuse_if_suspect(args.incident_dir, node, controller_db=args.controller_db)
    except SuspectNodeError as exc:
        print(f"replicheck launch: {exc}", file=sys.stderr)
        return EXIT_SUSPECT_NODE
    except (FileNotFoundError, OSError) as exc:
        print(f"replicheck launch: error: {exc}", file=sys.stderr)
        return 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(f"no unresolved incident names {node}")
        return 0
    directory = Path(args.incident_dir)
    before = set(directory.glob("*.json")) if directory.is_dir() else set()
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"replicheck launch: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    # Pass a scheduler's SIGTERM/SIGINT on to the command (torchrun stops its workers).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    status = child.wait()
    if status == 0:
        return 0
    new = sorted(set(directory.glob("*.json")) - before) if directory.is_dir() else []
    incidents = []
    for path in new:
        try:
            incidents.append((path, read_incident(path)))
        except IncidentFormatError as exc:
            print(f"replicheck launch: unreadable incident file: {exc}", file=sys.stderr)
    if not incidents:
        return status
    for path, incident in incidents:
        print(summary(incident, incident_path=path), file=sys.stderr)
    print(
        f"replicheck launch: command exited {status}; ending with {EXIT_CORRUPTION} (detection)",
        file=sys.stderr,
    )
    return EXIT_CORRUPTION


def _node_from_env() -> str:
    from replicheck.guard.runtime import RuntimeInfo

    return RuntimeInfo.from_env().node.name
