"""The error for an optional dependency that is not installed."""

from __future__ import annotations

from replicheck.controller.errors import ConfigError


class MissingExtraError(ConfigError, ImportError):
    """A backend needs a package from an optional extra. An ImportError for Python callers, and a
    ConfigError so the command line reports it as one line."""


def missing_extra(what: str, package: str, extra: str) -> MissingExtraError:
    """The error saying which extra installs ``package``."""
    return MissingExtraError(f"the {what} needs the {package!r} package: pip install 'replicheck[{extra}]'")
