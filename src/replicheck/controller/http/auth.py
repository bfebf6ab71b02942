"""Bearer tokens for the HTTP API: read from files, compared in constant time, two roles.

Standard library only. A token file holds one token per line, either ``TOKEN`` alone or
``NAME TOKEN``; blank lines and lines starting with ``#`` are ignored. A named token is an
identity (the name is what the audit log records); an unnamed one is shared, and a person
deciding with it must say who they are.
"""

from __future__ import annotations

import enum
import hmac
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from replicheck.controller.errors import ConfigError

MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused when the file is read: they can be guessed."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$")


class Role(str, enum.Enum):
    """What a token may do."""

    JOB = "job"
    """Post incidents (training jobs)."""
    OPERATOR = "operator"
    """List, inspect, approve and dismiss incidents (people)."""


@dataclass(frozen=True)
class Token:
    """One accepted secret."""

    role: Role
    """What the token may do."""
    secret: bytes = field(repr=False)
    """The token itself (never printed)."""
    name: str | None = None
    """Who holds it, when the file names them; None for a shared token."""


@dataclass(frozen=True)
class Principal:
    """Who sent an authenticated request."""

    role: Role
    name: str | None
    """The token's name, or None for a shared token."""


class AuthError(Exception):
    """A request is refused: ``status`` is 401 (no or unknown token) or 403 (wrong role)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def read_token_file(path: str | os.PathLike[str], role: Role) -> tuple[Token, ...]:
    """The tokens in ``path``; ConfigError for a missing, empty or malformed file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the {role.value} token file: {exc}") from exc
    tokens: list[Token] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ConfigError(f"{p}:{number}: expected 'TOKEN' or 'NAME TOKEN'")
        name, secret = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
        if name is not None and not _NAME.match(name):
            raise ConfigError(f"{p}:{number}: token name {name!r} must be letters, digits and ._@+-")
        if len(secret) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{p}:{number}: token shorter than {MIN_TOKEN_CHARS} characters")
        tokens.append(Token(role, secret.encode("utf-8"), name))
    if not tokens:
        raise ConfigError(f"{p}: no token in the {role.value} token file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Kubernetes secret mounts are often 0644, so this is said, not refused.
        import logging

        logging.getLogger("replicheck.http").warning("%s: token file is readable by others (chmod 600)", p)
    return tuple(tokens)


class Authenticator:
    """Checks ``Authorization: Bearer`` headers against the job and operator tokens."""

    def __init__(self, tokens: Sequence[Token]) -> None:
        self._tokens = tuple(tokens)
        secrets = [t.secret for t in self._tokens]
        if len(set(secrets)) != len(secrets):
            raise ConfigError("a token appears twice (job and operator tokens must be different secrets)")

    def roles(self) -> frozenset[Role]:
        return frozenset(t.role for t in self._tokens)

    def check(self, header: str | None, role: Role) -> Principal:
        """The principal behind ``header`` if it may act as ``role``; AuthError otherwise."""
        if not header:
            raise AuthError(401, "missing Authorization header (send 'Authorization: Bearer <token>')")
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
        offered = value.strip().encode("utf-8", "surrogateescape")
        found: Token | None = None
        for token in self._tokens:  # every token compared, each in constant time
            if hmac.compare_digest(offered, token.secret):
                found = token
        if found is None:
            if role not in self.roles():
                raise AuthError(401, f"this controller accepts no {role.value} token (none configured)")
            raise AuthError(401, "unknown token")
        if found.role is not role:
            raise AuthError(
                403, f"a {found.role.value} token may not do this; it needs the {role.value} token"
            )
        return Principal(found.role, found.name)


class RefusalBudget:
    """At most ``per_minute`` refused requests are audited one by one; the rest are counted
    and summarised in the next audited refusal, so a flood cannot fill the database."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._lock = threading.Lock()
        self._window = clock()
        self._used = 0
        self._dropped = 0

    def take(self) -> tuple[bool, int]:
        """(audit this one?, refusals not audited since the last audited one)."""
        with self._lock:
            now = self._clock()
            if now - self._window >= 60.0:
                self._window, self._used = now, 0
            if self._used >= self.per_minute:
                self._dropped += 1
                return False, 0
            self._used += 1
            dropped, self._dropped = self._dropped, 0
            return True, dropped
