"""ASGI middleware in front of the API: security headers, per-route request counts (unknown
methods and paths under one label each), a JSON 413 for bodies announced too large, a 408 for
bodies that do not arrive in time, and per-credential rate limits. Pure ASGI (no framework
imports). Streamed bodies are limited by FastAPI's ``max_body_size``, whose 413 the app turns
into the same JSON."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
)


METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
"""Methods counted under their own name; any other is counted as ``OTHER`` (one label, however
many distinct methods a client invents)."""


def method_label(method: str) -> str:
    return method if method in METHODS else "OTHER"


class BodyTimeout(Exception):
    """The request body did not arrive within the body timeout."""


class RateLimiter:
    """A token bucket per credential: ``per_minute`` requests a minute, in bursts of at most
    ``burst``. On the monotonic clock, so a wall-clock jump neither blocks nor frees anyone."""

    def __init__(
        self, per_minute: int, burst: int | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.rate = per_minute / 60.0
        self.burst = float(burst if burst is not None else max(1, per_minute // 2))
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0 when a request may go ahead now, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


def error_body(status: int, code: str, message: str) -> bytes:
    """The one JSON error shape: ``{"error": {"status", "code", "message"}}``."""
    return json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()


class Guard:
    """Adds security headers to every response, reports (method, route, status), and refuses a
    Content-Length over ``limit`` before the body is read."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        on_response: Callable[[str, str, int], None] | None = None,
        on_too_large: Callable[[], None] | None = None,
        body_timeout_s: float = 30.0,
    ) -> None:
        self.app = app
        self.limit = limit
        self.on_response = on_response
        self.on_too_large = on_too_large
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]
        method = method_label(str(scope.get("method", "")))
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            too_large = length.isdigit()
            if too_large and self.on_too_large is not None:
                self.on_too_large()
            code, text = (413, "too_large") if too_large else (400, "bad_request")
            message = f"request body larger than {self.limit} bytes" if too_large else "bad Content-Length"
            body = error_body(code, text, message)
            await send(
                {
                    "type": "http.response.start",
                    "status": code,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                        *SECURITY_HEADERS,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            if self.on_response is not None:
                self.on_response(method, "unrouted", code)
            return

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                message["headers"] = list(message.get("headers", [])) + list(SECURITY_HEADERS)
            await send(message)

        async def timed() -> Message:
            # A body trickled in byte by byte would hold a worker and a descriptor for ever.
            try:
                return await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                raise BodyTimeout from None

        try:
            await self.app(scope, timed, tracked)
        except BodyTimeout:
            if not status[0]:
                body = error_body(
                    408, "timeout", f"request body not received within {self.body_timeout_s:g} s"
                )
                await tracked(
                    {
                        "type": "http.response.start",
                        "status": 408,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
        finally:
            if self.on_response is not None and status[0]:
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.on_response(method, str(path), status[0])
