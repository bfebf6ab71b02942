"""Running the ASGI app with uvicorn in a background thread (the controller's reconcile loop
keeps the main thread), on a socket bound before start so port 0 works."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from replicheck.controller.errors import ConfigError


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6); ConfigError on anything else."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--http wants HOST:PORT (for example 127.0.0.1:8765), got {text!r}")
    return host, int(port)


class BackgroundServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread."""

    def __init__(self, app: Any, host: str, port: int, *, log_level: str = "warning") -> None:
        try:
            import uvicorn
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError("the HTTP API needs its extra: pip install 'replicheck[http]'") from exc
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
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=5
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
