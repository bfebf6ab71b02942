"""ASGI middleware in front of the API: security headers, per-route request counts, and a
JSON 413 for bodies announced too large. Pure ASGI (no framework imports). Streamed bodies
are limited by FastAPI's ``max_body_size``, whose 413 the app turns into the same JSON."""

from __future__ import annotations

import json
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
    ) -> None:
        self.app = app
        self.limit = limit
        self.on_response = on_response
        self.on_too_large = on_too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]
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
                self.on_response(str(scope.get("method", "")), "unrouted", code)
            return

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                message["headers"] = list(message.get("headers", [])) + list(SECURITY_HEADERS)
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            if self.on_response is not None and status[0]:
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.on_response(str(scope.get("method", "")), str(path), status[0])
