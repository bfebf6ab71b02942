"""ASGI middleware in front of the API: security headers and per-route request counts.
Pure ASGI (no framework imports). The body size limit is FastAPI's ``max_body_size``."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, MutableMapping

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
     b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
)


def error_body(status: int, code: str, message: str) -> bytes:
    """The one JSON error shape: ``{"error": {"status", "code", "message"}}``."""
    return json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()


class Guard:
    """Adds security headers to every response and reports (method, route, status)."""

    def __init__(self, app: ASGIApp, *, on_response: Callable[[str, str, int], None] | None = None) -> None:
        self.app = app
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

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
