"""Shared pieces of the controller's command-line commands: the --db option, turning
ControllerError into a one-line message, and plain-text rendering."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import sys
from typing import Any, Callable

from replicheck.controller.backends.base import NodeInfo
from replicheck.controller.errors import ControllerError
from replicheck.controller.model import Record

DEFAULT_DB = "replicheck-controller.db"
EXIT_USAGE = 2


def add_db_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, metavar="PATH",
                        help=f"controller database (default: $REPLICHECK_DB or ./{DEFAULT_DB})")


def db_path(args: argparse.Namespace) -> str:
    return str(args.db or os.environ.get("REPLICHECK_DB") or DEFAULT_DB)


def guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report controller errors as one line on stderr with exit status 2, never a traceback."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ControllerError as exc:
            print(f"replicheck: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except sqlite3.Error as exc:
            print(f"replicheck: error: database: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return wrapper


def record_line(r: Record) -> str:
    nodes = ",".join(r.targets) or "-"
    return f"{r.incident_id:<36} {r.state.value:<18} {r.job_id:<10} {nodes:<16} {r.reason}"


def record_detail(r: Record) -> list[str]:
    lines = [f"state:          {r.state.value}", f"reason:         {r.reason}",
             f"classification: {r.classification}", f"job:            {r.job_id}",
             f"nodes:          {', '.join(r.targets) or '-'}",
             f"cordoned:       {', '.join(r.cordoned) or '-'}"]
    lines += [f"not cordoned:   {n} ({why})" for n, why in r.cordon_skipped]
    if r.triage:
        lines.append("triage:")
        lines += [f"  {t.node}: {'passed' if t.passed else 'FAILED'} - {t.detail}" for t in r.triage]
    if r.checkpoint:
        lines.append(f"checkpoint:     step {r.checkpoint.get('step')} at {r.checkpoint.get('path')}")
    if r.approved_by:
        lines.append(f"approved:       by {r.approved_by} at {r.approved_at}")
    if r.dismissed_by:
        lines.append(f"dismissed:      by {r.dismissed_by} at {r.dismissed_at}")
    if r.resume:
        lines.append(f"resume:         {r.resume.get('detail', r.resume)}")
    return lines


def node_line(n: NodeInfo) -> str:
    return f"{n.name:<16} {n.state:<14} {','.join(n.partitions):<12} {n.reason}"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def ingest_files(ctl: Any, paths: Any) -> int:
    """Ingest incident files, one line each; 1 when any was rejected (and kept), else 0."""
    status = 0
    for path in paths:
        result = ctl.ingest_file(path)
        if result.rejected:
            print(f"replicheck: rejected {result.source}: {result.rejected} (kept in the database)",
                  file=sys.stderr)
            status = 1
        else:
            print(f"ingested {result.incident_id}{'' if result.new else ' (duplicate merged)'}")
    return status
