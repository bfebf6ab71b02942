"""What the guard is doing right now, for user hooks and fault injectors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

PassName = Literal["idle", "train", "probe", "replay", "optimizer", "rebuild", "selftest"]
"""What the process is running: a training pass, a probe, a replay, the optimizer step..."""


@dataclass
class _State:
    step: int = -1
    pass_: PassName = "idle"
    replaying: bool = False


# Process-wide, not thread-local: backward hooks run on autograd worker threads (one per
# device) and communication-hook callbacks on the backend's threads, and both must see it.
_STATE = _State()


def _state() -> _State:
    return _STATE


def is_replaying() -> bool:
    """True on every pass whose result the guard discards (a replay, an ``extra`` probe, the
    bucket-rebuild pass after a resume): hooks with side effects (logging, caches, counters)
    skip them. False on every pass that trains the model, including a ``split`` probe."""
    return _state().replaying


def current_step() -> int:
    """The step the guard is running (``-1`` outside :meth:`Guard.step`)."""
    return _state().step


def current_pass() -> PassName:
    """Which pass runs now: ``train``, ``probe`` (this rank's own probe), ``replay``, or ``idle``."""
    return _state().pass_


@contextmanager
def running(step: int, pass_: PassName, *, discarded: bool = False) -> Iterator[None]:
    """Mark the process as running ``pass_`` of ``step``; ``discarded``: its result is thrown away."""
    state = _state()
    saved = (state.step, state.pass_, state.replaying)
    state.step, state.pass_ = step, pass_
    state.replaying = discarded or pass_ in ("replay", "rebuild")
    try:
        yield
    finally:
        state.step, state.pass_, state.replaying = saved
