"""The single ``replicheck`` entry point.

Each subcommand lives in its own module under ``replicheck.cli`` exposing ``register(subparsers)``
(which must stay cheap: no torch import) and sets ``func`` on its parser. Heavy imports happen
inside the command's function, so ``replicheck controller`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
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
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replicheck",
        description="Detect silent data corruption in distributed PyTorch training and recover.",
    )
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
        parser.print_help(sys.stderr)
        return 2
    from replicheck.cli._support import run_guarded

    return run_guarded(func, args)
