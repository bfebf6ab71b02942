"""Where a guarded step's time goes: wall time of the guard's phases, measured from outside.

The guard has no timing hook, so :class:`PhaseTimer` wraps, for the duration of a ``with`` block,
the functions each phase runs through (looked up by name; one that does not exist in this
version of the guard is reported as not found, never an error). Each wrapper adds its call's
wall time (``perf_counter``) to its component, minus the time of wrapped calls nested in it
(exclusive time), so the components add up. An *absorbing* component keeps the time of the
wrapped calls nested in it (the weights digest calls the per-tensor digests: that is weights
time, not probe-fingerprint time). Time is kept per thread: work on the communication threads
overlaps the main thread's and is reported apart.

The wrappers are internal names of the guard and may move; they time, they never change what
runs.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """One function to time: ``module:qualname`` (a module function or a class attribute)."""

    path: str
    """``"replicheck.guard.transport.comm:Comm.gather_rows"``."""
    component: str
    """The component its time is added to."""
    absorbing: bool = False
    """Nested wrapped calls add to this component instead of their own."""


@dataclass
class _Frame:
    """A wrapped call in progress on one thread."""

    absorbing: bool
    nested: float = 0.0
    """Wall time of the wrapped calls made inside it so far."""


class PhaseTimer:
    """Exclusive wall time per component while installed; see the module docstring."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.missing: list[str] = []
        self._local = threading.local()

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _wrap(self, fn: Callable[..., Any], target: Target) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            if any(f.absorbing for f in stack):  # inside an absorbing component
                return fn(*args, **kwargs)
            frame = _Frame(absorbing=target.absorbing)
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                stack.pop()
                name = target.component
                if threading.current_thread() is not threading.main_thread():
                    name += " [other thread]"
                self.totals[name] += elapsed - frame.nested
                self.calls[name] += 1
                if stack:
                    stack[-1].nested += elapsed

        return timed

    @contextmanager
    def installed(self) -> Iterator[PhaseTimer]:
        undo: list[tuple[Any, str, Any]] = []
        for t in self.targets:
            module_name, _, qual = t.path.partition(":")
            try:
                owner: Any = importlib.import_module(module_name)
                *parents, attr = qual.split(".")
                for p in parents:
                    owner = getattr(owner, p)
                original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            except (ImportError, AttributeError, KeyError):
                self.missing.append(t.path)
                continue
            setattr(owner, attr, self._wrap(original, t))
            undo.append((owner, attr, original))
        try:
            yield self
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


GUARD_PHASES = [
    Target("replicheck.guard.step.passes:StepPasses.own_probe", "own probe: split-off forward + backward"),
    Target("replicheck.guard.step.passes:StepPasses.backward", "training passes (rest of the batch)"),
    Target(
        "replicheck.guard.step.replay:Recompute.payload", "replay of the received probe: forward + backward"
    ),
    Target("replicheck.fingerprint:digests", "probe fingerprints (digests)", absorbing=True),
    Target("replicheck.fingerprint:model_digest_tensor", "weights + optimizer-state digests", absorbing=True),
    Target(
        "replicheck.fingerprint:optimizer_digest_tensor", "weights + optimizer-state digests", absorbing=True
    ),
    Target("replicheck.fingerprint:row_digest", "reduced-gradient digests"),
    Target("replicheck.guard.transport.comm:Comm.exchange", "ring exchange of probes"),
    Target("replicheck.guard.transport.comm:Comm.gather_rows", "the step's all-gather"),
]
"""The guard's phases as of this writing; a missing name is reported, not fatal (and
tests/benchmarks/test_phases.py fails on one, and on one a guarded DDP step never calls)."""

SHARDED_PHASES = [
    *GUARD_PHASES,
    Target(
        "replicheck.guard.step.flags:FailureFlags.share", "per-forward failure flag (FSDP2)", absorbing=True
    ),
    Target("replicheck.guard.checks.scatter:sketch_chunks", "reduce-scatter check: sketches"),
    Target(
        "replicheck.guard.checks.scatter:ScatterCheck.status",
        "reduce-scatter check: the reduce-scatter of sketches and the verdict",
    ),
]
"""FSDP2 adds the failure flag shared after each forward (a DDP step shares none) and the plain
FSDP2 reduce-scatter check (the sketches of each reduce-scatter's input and output; once per
step, the reduce-scatter of the sketches and the verdict)."""
