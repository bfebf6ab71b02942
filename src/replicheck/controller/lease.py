"""The controller lease: an exclusive lock on ``<db>.lock`` held while a controller acts.

A file lock (``flock``) rather than a row with an expiry: the kernel drops it the moment the
holder dies, so a controller restarted after SIGKILL takes over at once, and no clock skew or
slow backend call can let two holders overlap. SQLite in WAL mode already requires every
process to be on the same host, which is where ``flock`` is reliable.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from replicheck.controller.errors import LeaseHeldError, StoreError


class Lease:
    """Held from :meth:`acquire` until :meth:`release` (or the process ends)."""

    def __init__(self, db_path: str | Path) -> None:
        self.path = Path(f"{db_path}.lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeldError naming the holder. Idempotent while held."""
        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot open the controller lease file: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise LeaseHeldError(
                f"another controller holds the lease on this database ({holder or 'unknown holder'}); "
                "this one does not act"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"{self.path}: cannot lock the controller lease file: {exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
