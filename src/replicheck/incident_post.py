"""Posting an incident to the controller's HTTP API from the training side: standard library
only (urllib), retried with exponential backoff, and written to a local directory when the
controller cannot take it, so nothing is lost while the controller is down.

A post is idempotent: the incident id is stable and the controller merges duplicates, so a
retry after a lost answer is harmless.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from replicheck.incident import Incident, write_incident

RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
"""Answers worth trying again; any other 4xx means the controller refused this record."""


class PostConfigError(ValueError):
    """The poster's settings (URL, token file, limits) are unusable."""


@dataclass(frozen=True, kw_only=True)
class PostConfig:
    """Where and how to post incidents."""

    url: str
    """The controller's base URL, for example ``http://controller:8765``."""
    token: str = field(repr=False)
    """The job token (read from a file with :func:`read_token`; never printed)."""
    fallback_dir: str | None = None
    """Directory the incident is written to when it cannot be delivered (the controller's
    watched incident directory is a good choice); None: no fallback file."""
    attempts: int = 5
    """Posts tried before giving up (the first included)."""
    base_delay_s: float = 0.5
    """Delay before the second attempt; doubled each time, with jitter."""
    max_delay_s: float = 10.0
    """Upper bound of one delay (also of an honoured Retry-After)."""
    timeout_s: float = 10.0
    """Timeout of one HTTP request."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise PostConfigError(f"controller URL must start with http:// or https://, got {self.url!r}")
        if not self.token or any(c.isspace() for c in self.token):
            raise PostConfigError("the job token must be a non-empty word")
        if self.attempts < 1:
            raise PostConfigError("attempts must be >= 1")
        for name in ("base_delay_s", "max_delay_s", "timeout_s"):
            if getattr(self, name) < 0:
                raise PostConfigError(f"{name} must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PostConfig | None:
        """From ``REPLICHECK_CONTROLLER_URL``, ``REPLICHECK_JOB_TOKEN_FILE`` and optional
        ``REPLICHECK_INCIDENT_FALLBACK_DIR``; None when no URL is set (posting is off)."""
        env = os.environ if env is None else env
        url = env.get("REPLICHECK_CONTROLLER_URL")
        if not url:
            return None
        token_file = env.get("REPLICHECK_JOB_TOKEN_FILE")
        if not token_file:
            raise PostConfigError("REPLICHECK_CONTROLLER_URL is set but REPLICHECK_JOB_TOKEN_FILE is not")
        return cls(
            url=url, token=read_token(token_file), fallback_dir=env.get("REPLICHECK_INCIDENT_FALLBACK_DIR")
        )


@dataclass(frozen=True)
class PostResult:
    """What happened to one incident."""

    delivered: bool
    """The controller stored it (201) or already had it (200)."""
    attempts: int
    """HTTP requests made."""
    status: int | None = None
    """The last HTTP status received (None if the controller was never reached)."""
    error: str | None = None
    """Why it was not delivered."""
    fallback_path: Path | None = None
    """Where it was written instead, if it was not delivered."""


def read_token(path: str | os.PathLike[str]) -> str:
    """The job token in ``path``: its first non-comment line, ``TOKEN`` or ``NAME TOKEN``."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PostConfigError(f"{p}: cannot read the job token: {exc}") from exc
    for line in lines:
        words = line.split()
        if words and not words[0].startswith("#"):
            return words[-1]
    raise PostConfigError(f"{p}: no token in the file")


def post_incident(
    incident: Incident, config: PostConfig, *, sleep: Callable[[float], None] = time.sleep
) -> PostResult:
    """Post ``incident``; on final failure write it to ``config.fallback_dir``. Never raises
    for network or server trouble (the result says what happened)."""
    body = incident.to_json().encode("utf-8")
    endpoint = config.url.rstrip("/") + "/api/v1/incidents"
    status: int | None = None
    error = ""
    made = 0
    for attempt in range(config.attempts):
        made = attempt + 1
        retry_after: float | None = None
        request = urllib.request.Request(
            endpoint,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {config.token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
                return PostResult(True, made, status=response.status)
        except ValueError as exc:  # a URL urllib cannot use: no retry will help
            error = f"cannot post to {endpoint}: {exc}"
            break
        except urllib.error.HTTPError as exc:
            status = exc.code
            error = f"HTTP {exc.code}: {_message(exc)}"
            if exc.code not in RETRY_STATUS:
                break  # refused for good: retrying sends the same refused record
            retry_after = _retry_after(exc.headers.get("Retry-After"))
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            error = f"cannot reach {endpoint}: {reason}"
        if attempt + 1 < config.attempts:
            delay = min(config.max_delay_s, config.base_delay_s * 2**attempt)
            delay = random.uniform(delay / 2, delay)  # jitter: ranks of one job do not retry in step
            if retry_after is not None:
                delay = max(delay, min(retry_after, config.max_delay_s))
            sleep(delay)
    fallback = None
    if config.fallback_dir:
        try:
            fallback = write_incident(incident, config.fallback_dir)
        except (OSError, ValueError) as exc:
            # Both ways out failed: say so in the result (the caller still holds the incident).
            error = f"{error}; fallback {config.fallback_dir} not written either: {exc}"
    return PostResult(False, made, status=status, error=error, fallback_path=fallback)


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        data = json.loads(exc.read(65536) or b"{}")
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return str(exc.reason)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: the exponential delay is used instead
