"""The single ``replicheck`` entry point.

Each subcommand lives in its own module under ``replicheck.cli`` exposing ``register(subparsers)``
(which must stay cheap: no torch import) and sets ``func`` on its parser. Heavy imports happen
inside the command's function, so ``replicheck controller`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Subcommand modules, in help order. A module that is missing is skipped with a note.
_COMMANDS = (
    "demo",
    "campaign",
    "selftest",
    "controller",
    "incidents",
    "nodes",
    "audit",
    "launch",
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("replicheck")
    except PackageNotFoundError:  # running from a source tree that was not installed
        from replicheck import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replicheck",
        description="Detect silent data corruption in distributed PyTorch training and recover.",
    )
    parser.add_argument("--version", action="version", version=f"replicheck {_version()}")
    from replicheck.cli._logging import add_logging_arguments

    add_logging_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"replicheck.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"replicheck.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # Bare ``replicheck``: the help is what was asked for, not a usage error.
        parser.print_help(sys.stdout)
        return 0
    from replicheck.cli._logging import configure_logging
    from replicheck.cli._support import run_guarded

    configure_logging(args)
    try:
        return run_guarded(func, args)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly; point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
