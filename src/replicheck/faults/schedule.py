"""When a fault acts: persistent from a step, transient at one step, or intermittent.

A schedule is a frozen description; :meth:`Schedule.trigger` makes the small stateful object
that decides, for each corruption opportunity (an *event*: one activation, one gradient, one
update...), whether the fault acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from replicheck.faults.errors import FaultConfigError


class Trigger:
    """Decides per event; holds the state a schedule needs (events used, random stream)."""

    def __init__(self, schedule: Schedule, seed: int) -> None:
        self.schedule = schedule
        self.gen = torch.Generator().manual_seed(seed)
        self._used: dict[int, int] = {}

    def fires(self, step: int) -> bool:
        s = self.schedule
        if isinstance(s, Persistent):
            return step >= s.start
        if isinstance(s, Transient):
            if step != s.step or self._used.get(step, 0) >= s.events:
                return False
            self._used[step] = self._used.get(step, 0) + 1
            return True
        if isinstance(s, Intermittent):
            if step < s.start or (s.stop is not None and step > s.stop):
                return False
            return bool(torch.rand((), generator=self.gen) < s.p)
        raise FaultConfigError(f"unknown schedule {s!r}")


@runtime_checkable
class Schedule(Protocol):
    """A description of when a fault acts."""

    @property
    def onset(self) -> int: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class Persistent:
    """Acts on every event from step ``start`` on (a broken unit)."""

    start: int = 0
    """First step affected."""

    def __post_init__(self) -> None:
        if self.start < 0:
            raise FaultConfigError(f"start must be >= 0, got {self.start}")

    @property
    def onset(self) -> int:
        return self.start

    def describe(self) -> str:
        return f"persistent from step {self.start}"


@dataclass(frozen=True, kw_only=True)
class Transient:
    """Acts on the first ``events`` events of step ``step`` only (a one-shot upset)."""

    step: int
    """The step affected."""
    events: int = 1
    """How many events of that step are hit (1: exactly one tensor, once)."""

    def __post_init__(self) -> None:
        if self.step < 0 or self.events < 1:
            raise FaultConfigError("need step >= 0 and events >= 1")

    @property
    def onset(self) -> int:
        return self.step

    def describe(self) -> str:
        n = "" if self.events == 1 else f" ({self.events} events)"
        return f"transient at step {self.step}{n}"


@dataclass(frozen=True, kw_only=True)
class Intermittent:
    """Acts on each event with probability ``p`` between ``start`` and ``stop`` (seeded)."""

    p: float
    """Probability per event."""
    start: int = 0
    """First step that may be affected."""
    stop: int | None = None
    """Last step that may be affected (``None``: no end)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise FaultConfigError(f"p must be in [0, 1], got {self.p}")
        if self.start < 0 or (self.stop is not None and self.stop < self.start):
            raise FaultConfigError("need 0 <= start <= stop")

    @property
    def onset(self) -> int:
        return self.start

    def describe(self) -> str:
        end = "" if self.stop is None else f" to {self.stop}"
        return f"intermittent p={self.p:g} from step {self.start}{end}"
