"""``-v`` / ``--quiet`` / ``--log-format``: how the library's ``logging`` records reach stderr.

The library itself only logs (a ``NullHandler`` sits on the ``replicheck`` logger); the CLI is
the application, so it is the one place that attaches a handler.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from replicheck.timefmt import utc_iso_us


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more to stderr (-v: INFO, -vv: DEBUG; default: WARNING)",
    )
    group.add_argument("-q", "--quiet", action="store_true", help="log only errors")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log line format on stderr (json: one object per line)",
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": utc_iso_us(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, sort_keys=True, default=str)


def level_for(verbose: int, quiet: bool) -> int:
    if quiet:
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)


def configure_logging(args: argparse.Namespace) -> None:
    """Attach one stderr handler to the ``replicheck`` logger at the level the flags ask for."""
    logger = logging.getLogger("replicheck")
    handler = logging.StreamHandler(sys.stderr)
    if getattr(args, "log_format", "text") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("replicheck: %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level_for(getattr(args, "verbose", 0), getattr(args, "quiet", False)))
