"""Shared pieces of the cluster-side commands: the --db option, the one error wrapper, and
output that cannot be forged (every value printed is escaped; JSON is strict)."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterable
from typing import Any

from replicheck.incident import json_safe

DEFAULT_DB = "replicheck-controller.db"
EXIT_USAGE = 2
EXCERPT_BYTES = 200
"""How much of a rejected input is shown (escaped); the rest stays in the database."""


def add_actions(subparsers: Any, name: str, help: str) -> Any:
    """The ``replicheck NAME ACTION`` command: its parser's subparsers, one per action; an
    action is required (the chosen one lands in ``args.<name>_command``)."""
    parser = subparsers.add_parser(name, help=help)
    return parser.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)


# ``default`` of the shared options below: a subcommand that repeats its parent's option passes
# ``argparse.SUPPRESS``, so its own default does not overwrite a value given before it
# (``nodes --db X list``).


def add_json_argument(parser: argparse.ArgumentParser, default: Any = False) -> None:
    parser.add_argument("--json", action="store_true", default=default, help="machine-readable output")


def add_db_argument(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument(
        "--db",
        default=default,
        metavar="PATH",
        help=f"controller database (default: $REPLICHECK_DB or ./{DEFAULT_DB})",
    )


def db_path(args: argparse.Namespace) -> str:
    return str(args.db or os.environ.get("REPLICHECK_DB") or DEFAULT_DB)


def add_slurm_conf_argument(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument(
        "--slurm-conf", default=default, metavar="PATH", help="slurm.conf (default: $SLURM_CONF)"
    )


def slurm_conf(args: argparse.Namespace) -> str | None:
    """The slurm.conf the Slurm client commands are given: ``--slurm-conf``, else $SLURM_CONF."""
    return args.slurm_conf or os.environ.get("SLURM_CONF")


def existing_db_path(args: argparse.Namespace) -> str:
    """The database a read-only verb opens: it must exist (a read never creates state)."""
    from replicheck.controller.errors import ConfigError

    path = db_path(args)
    if not os.path.isfile(path):
        raise ConfigError(
            f"no controller database at {path} (give --db PATH or set REPLICHECK_DB; "
            "'replicheck controller run' or 'replicheck nodes add' creates one)"
        )
    return path


def run_guarded(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command; a controller or database error is one escaped line on stderr, exit 2."""
    from replicheck.controller.errors import ControllerError

    try:
        return int(func(args) or 0)
    except ControllerError as exc:
        print(f"replicheck: error: {esc(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except sqlite3.Error as exc:
        print(f"replicheck: error: database: {esc(str(exc))}", file=sys.stderr)
        return EXIT_USAGE


def esc(value: object) -> str:
    """``value`` as one printable line: control characters, escape sequences, ``\\r``, newlines
    and other non-printable characters become ``\\xNN`` / ``\\uNNNN`` escapes."""
    text = str(value)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


def excerpt(content: bytes, limit: int = EXCERPT_BYTES) -> str:
    """A short, escaped view of rejected input (never the whole file)."""
    head = esc(content[:limit].decode("utf-8", "backslashreplace"))
    return head + (f"... ({len(content)} bytes)" if len(content) > limit else "")


def print_json(data: Any) -> None:
    """Strict JSON (no NaN/Infinity): non-finite numbers are written as strings."""
    print(json.dumps(json_safe(data), indent=2, sort_keys=True, default=str, allow_nan=False))


def ingest_files(ctl: Any, paths: Iterable[str]) -> int:
    """Ingest incident files, one line each; 1 when any was rejected (and kept), else 0."""
    status = 0
    for path in paths:
        result = ctl.ingest_file(path)
        if result.rejected:
            print(
                f"replicheck: rejected {esc(result.source)}: {esc(result.rejected)} (kept in the database)",
                file=sys.stderr,
            )
            status = 1
        else:
            print(f"ingested {esc(result.incident_id)}{'' if result.new else ' (duplicate merged)'}")
    return status
