"""Tensors handed to gloo, held until its worker thread has let go of them.

Gloo releases a finished operation on its worker thread, slightly after ``wait()`` returns. If
Python has dropped the operation's tensors by then, that release frees them, which takes the
GIL; when it happens while the interpreter exits, taking the GIL ends the worker thread inside
C++ and the process aborts ("terminate called without an active exception"; seen at the end of
guarded jobs, one exit in a few dozen). Every tensor the guard gives a collective is therefore
held here, dropped once nothing but its Python object refers to it, and at interpreter exit
(``atexit`` runs before finalisation) the remaining ones are waited for, briefly.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Iterable

import torch


class InFlight:
    """The held tensors of one process."""

    def __init__(self, exit_wait_s: float = 2.0) -> None:
        self._held: list[torch.Tensor] = []
        self._exit_wait_s = exit_wait_s
        self._registered = False

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` alive until the communication backend has released them."""
        self._held = [t for t in self._held if _in_use(t)]
        self._held.extend(tensors)
        if not self._registered:
            atexit.register(self.drain)
            self._registered = True

    def drain(self) -> None:
        """Wait (bounded) until the backend has released every held tensor, then drop them."""
        deadline = time.monotonic() + self._exit_wait_s
        while any(_in_use(t) for t in self._held) and time.monotonic() < deadline:
            time.sleep(0.001)  # lets the worker thread take the GIL if it needs it
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


def _in_use(t: torch.Tensor) -> bool:
    # One reference is the Python object's own; any other is the backend's (or a live view's).
    count: int = t._use_count()  # type: ignore[attr-defined]  # private, untyped in torch
    return count > 1


IN_FLIGHT = InFlight()
"""The process's holder (gloo's worker threads are per process, too)."""
