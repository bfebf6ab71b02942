"""Bearer tokens for the HTTP API: read from files, compared in constant time, two roles.

Standard library only. A token file holds one token per line, either ``TOKEN`` alone or
``NAME TOKEN``, and for job tokens optionally a scope last: ``NAME TOKEN jobs=PATTERN[,PATTERN]``;
blank lines and lines starting with ``#`` are ignored. A named token is an identity (the name is
what the audit log records); an unnamed one is shared, and a person deciding with it must say who
they are. A scoped job token speaks only for the job ids its patterns match (``*`` matches any
run of job-id characters except ``/``); an unscoped one speaks for every job and is warned about.
A token "file" may be a directory: every non-hidden regular file in it is read (one file per job,
written by a Slurm prolog or a Kubernetes Secret key), and :class:`TokenSource` re-reads it when
it changes, so a job's token stops working when its file is removed.
"""

from __future__ import annotations

import enum
import hmac
import logging
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
_PATTERN_PART = r"[A-Za-z0-9*][A-Za-z0-9._+*-]{0,127}"
_JOB_PATTERN = re.compile(rf"^{_PATTERN_PART}(/{_PATTERN_PART})?$")
"""A job-id pattern: the job-id grammar with ``*`` wildcards."""
log = logging.getLogger("replicheck.http")


def job_pattern_matches(pattern: str, job_id: str) -> bool:
    """Whether ``job_id`` matches ``pattern`` (``*``: any run of job-id characters but ``/``)."""
    regex = "".join("[A-Za-z0-9._+-]*" if c == "*" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, job_id) is not None


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
    jobs: tuple[str, ...] | None = None
    """For a job token: the job-id patterns it speaks for (None: unscoped, every job)."""


@dataclass(frozen=True)
class Principal:
    """Who sent an authenticated request."""

    role: Role
    name: str | None
    """The token's name, or None for a shared token."""
    jobs: tuple[str, ...] | None = None
    """For a job token: the job-id patterns it speaks for (None: unscoped, every job)."""

    def speaks_for(self, job_id: str) -> bool:
        """Whether this credential may report on ``job_id``."""
        return self.jobs is None or any(job_pattern_matches(p, job_id) for p in self.jobs)

    def vouches(self) -> str:
        """What the audit log and the record say vouched for the job ("" for an unscoped token)."""
        if self.jobs is None:
            return ""
        return f"job token {self.name or '(unnamed)'} (jobs={','.join(self.jobs)})"


class AuthError(Exception):
    """A request is refused: ``status`` is 401 (no or unknown token) or 403 (wrong role)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def read_token_file(path: str | os.PathLike[str], role: Role) -> tuple[Token, ...]:
    """The tokens in ``path`` (a file, or a directory of token files); ConfigError for a missing,
    empty or malformed file. An empty directory is allowed for job tokens (no job running)."""
    p = Path(path)
    if p.is_dir():
        found: list[Token] = []
        for entry in sorted(p.iterdir()):
            # Kubernetes Secret volumes hold ..data links and dot-files; only plain files count.
            if entry.name.startswith(".") or not entry.is_file():
                continue
            found += _read_one(entry, role, allow_empty=True)
        if not found and role is not Role.JOB:
            raise ConfigError(f"{p}: no token in the {role.value} token directory")
        return tuple(found)
    return _read_one(p, role, allow_empty=False)


def _read_one(p: Path, role: Role, *, allow_empty: bool) -> tuple[Token, ...]:
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
        jobs: tuple[str, ...] | None = None
        if len(parts) > 1 and parts[-1].startswith("jobs="):
            if role is not Role.JOB:
                raise ConfigError(f"{p}:{number}: jobs= scopes job tokens only")
            jobs = tuple(parts.pop()[len("jobs=") :].split(","))
            bad = [j for j in jobs if not _JOB_PATTERN.match(j)]
            if bad:
                raise ConfigError(f"{p}:{number}: job pattern {bad[0]!r} must be a job id, '*' allowed")
        if len(parts) > 2:
            raise ConfigError(f"{p}:{number}: expected 'TOKEN' or 'NAME TOKEN' (then 'jobs=PATTERN,...')")
        name, secret = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
        if name is not None and not _NAME.match(name):
            raise ConfigError(f"{p}:{number}: token name {name!r} must be letters, digits and ._@+-")
        if len(secret) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{p}:{number}: token shorter than {MIN_TOKEN_CHARS} characters")
        tokens.append(Token(role, secret.encode("utf-8"), name, jobs))
        who = f"{p}:{number} ({name or 'unnamed'})"
        if role is Role.JOB and jobs is None:
            log.warning(
                "%s: unscoped job token: it speaks for every job and auto-approve never acts on its "
                "incidents; scope it with 'jobs=JOB_ID' (docs/http.md)",
                who,
            )
        elif jobs is not None and "*" in jobs:
            log.warning("%s: job token scoped to '*': it speaks for every job", who)
    if not tokens and not allow_empty:
        raise ConfigError(f"{p}: no token in the {role.value} token file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Kubernetes secret mounts are often 0644, so this is said, not refused.
        log.warning("%s: token file is readable by others (chmod 600)", p)
    return tuple(tokens)


class TokenSource:
    """Tokens of one role read from a file or directory, re-read when it changes (a job's token
    is added by the prolog and removed at job end). A change that does not parse keeps the last
    good tokens and is logged."""

    def __init__(self, path: str | os.PathLike[str], role: Role) -> None:
        self.path, self.role = Path(path), role
        self._stamp = self._state()
        self._tokens = read_token_file(self.path, role)
        self._lock = threading.Lock()

    def _state(self) -> tuple[tuple[str, int, int, int], ...]:
        p = self.path
        try:
            entries = [p] + (
                sorted(e for e in p.iterdir() if not e.name.startswith(".")) if p.is_dir() else []
            )
            out = []
            for e in entries:
                st = e.stat()
                out.append((e.name, st.st_mtime_ns, st.st_size, st.st_ino))
            return tuple(out)
        except OSError:
            return ()

    def tokens(self) -> tuple[Token, ...]:
        """The current tokens (re-read first if the file or directory changed)."""
        with self._lock:
            stamp = self._state()
            if stamp != self._stamp:
                try:
                    self._tokens = read_token_file(self.path, self.role)
                    self._stamp = stamp
                except ConfigError as exc:
                    log.error(
                        "%s changed but cannot be read; keeping the previous tokens: %s", self.path, exc
                    )
            return self._tokens


class Authenticator:
    """Checks ``Authorization: Bearer`` headers against the job and operator tokens (fixed ones,
    plus those of ``sources``, re-read when their files change)."""

    def __init__(self, tokens: Sequence[Token], sources: Sequence[TokenSource] = ()) -> None:
        self._fixed = tuple(tokens)
        self._sources = tuple(sources)
        self._tokens = self._fixed
        self._check_distinct(self._all())

    def _all(self) -> tuple[Token, ...]:
        return self._fixed + tuple(t for s in self._sources for t in s.tokens())

    @staticmethod
    def _check_distinct(tokens: Sequence[Token]) -> None:
        secrets = [t.secret for t in tokens]
        if len(set(secrets)) != len(secrets):
            raise ConfigError("a token appears twice (job and operator tokens must be different secrets)")

    def _current(self) -> tuple[Token, ...]:
        if not self._sources:
            return self._fixed
        tokens = self._all()
        if tokens != self._tokens:
            try:
                self._check_distinct(tokens)
                self._tokens = tokens
            except ConfigError as exc:
                log.error("token files changed: %s; keeping the previous tokens", exc)
        return self._tokens

    def roles(self) -> frozenset[Role]:
        return frozenset(t.role for t in self._current()) | frozenset(s.role for s in self._sources)

    def check(self, header: str | None, role: Role) -> Principal:
        """The principal behind ``header`` if it may act as ``role``; AuthError otherwise."""
        if not header:
            raise AuthError(401, "missing Authorization header (send 'Authorization: Bearer <token>')")
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
        offered = value.strip().encode("utf-8", "surrogateescape")
        found: Token | None = None
        for token in self._current():  # every token compared, each in constant time
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
        return Principal(found.role, found.name, found.jobs)


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
