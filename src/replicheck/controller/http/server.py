"""Running the ASGI app with uvicorn in a background thread (the controller's reconcile loop
keeps the main thread), on a socket bound before start so port 0 works.

Connections are bounded at the door: at most ``max_connections`` open at once (an idle one, that
has sent no request yet or waits between requests, is closed to make room; when every one is
busy the new one is closed), and a connection that has not sent its request headers within
``header_timeout_s`` is closed. So idle or slow connections cannot use up the process's file
descriptors, which the reconcile loop and SQLite need too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from replicheck.controller.errors import ConfigError

ACCEPT_BACKLOG = 64
"""Listen queue, and connections accepted in one go before the cap is applied."""
DESCRIPTOR_RESERVE = 128
"""File descriptors left to everything but client connections (database, backend, log files)."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6); ConfigError on anything else."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--http wants HOST:PORT (for example 127.0.0.1:8765), got {text!r}")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Limits the HTTP server enforces per connection."""

    max_connections: int = 256
    """Client connections open at once; also capped at half the descriptors the process may
    open (less a reserve), so the controller never runs out of them."""
    header_timeout_s: float = 10.0
    """A connection must send its request headers within this long of opening."""
    keep_alive_s: float = 5.0
    """An idle connection between requests is closed after this long."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses whose ``X-Forwarded-For`` / ``X-Forwarded-Proto`` are believed (a reverse
    proxy in front of the controller). Empty: those headers are ignored, and the client address
    recorded is the socket's peer."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError("max_connections (--max-connections) must be at least 1")
        for name in ("header_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                flag = " (--header-timeout)" if name == "header_timeout_s" else ""
                raise ConfigError(f"{name}{flag} must be positive")
        for proxy in self.trusted_proxies:
            # A typo would silently trust no one (or, as a hostname, fail only at start in uvicorn).
            try:
                ipaddress.ip_network(proxy)
            except ValueError:
                raise ConfigError(
                    f"trusted proxy (--trusted-proxy) {proxy!r} is not an IP address or network "
                    "(for example 10.0.0.5 or 10.0.0.0/24)"
                ) from None

    def connection_cap(self) -> int:
        """``max_connections``, lowered to fit the process's descriptor limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, (soft - DESCRIPTOR_RESERVE - ACCEPT_BACKLOG) // 2))


def _bounded_protocol(limits: ServerLimits) -> type[Any]:
    """uvicorn's h11 protocol with a connection cap and a header timeout."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = limits.connection_cap()

    class BoundedH11Protocol(H11Protocol):
        opened_at = 0.0
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.opened_at = time.monotonic()
            if len(self.connections) > cap and not self._make_room():
                transport.close()  # every connection is busy: this one is refused
                return
            self.header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_due)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # Between two requests of a kept-alive connection the next headers get the same time.
            if self.header_timer is None and self.cycle is not None and self.cycle.response_complete:
                previous = self.cycle
                self.header_timer = self.loop.call_later(
                    limits.header_timeout_s, lambda: self._next_headers_due(previous)
                )
            super().data_received(data)

        def _next_headers_due(self, previous: Any) -> None:
            self.header_timer = None
            if self.cycle is previous and not self.transport.is_closing():
                self.transport.close()

        def _idle(self) -> bool:
            return self.cycle is None or bool(self.cycle.response_complete)

        def _make_room(self) -> bool:
            idle = [c for c in self.connections if c is not self and getattr(c, "_idle", lambda: False)()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: getattr(c, "opened_at", 0.0))
            oldest.transport.close()
            oldest.connections.discard(oldest)
            return True

        def _headers_due(self) -> None:
            self.header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()  # no request headers in time (idle or slowloris)

    return BoundedH11Protocol


class BackgroundServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
    ) -> None:
        try:
            import uvicorn
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError("the HTTP API needs its extra: pip install 'replicheck[http]'") from exc
        limits = limits or ServerLimits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self.limits = limits
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            http=_bounded_protocol(limits),
            # asyncio accepts up to `backlog` connections per wake-up before any is looked at: a
            # short queue keeps one burst from taking every descriptor left.
            backlog=ACCEPT_BACKLOG,
            timeout_keep_alive=max(1, round(limits.keep_alive_s)),
            # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: only when configured here.
            proxy_headers=bool(limits.trusted_proxies),
            forwarded_allow_ips=list(limits.trusted_proxies) or None,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="replicheck-http", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise ConfigError(f"the HTTP server on {self.url} stopped while starting")
            if time.monotonic() > deadline:
                raise ConfigError(f"the HTTP server on {self.url} did not start within {timeout:g} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
