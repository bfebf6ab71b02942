"""This rank's row of a step, and on a verification step its part of the ring: send its probe to
its verifier, replay its source's probe, and measure the replay noise while calibrating."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from replicheck.guard.attribution.compare import compare
from replicheck.guard.attribution.resolve import LocalView
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.checks import scaling
from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import Mode
from replicheck.guard.step.failure import StepFailure
from replicheck.guard.step.passes import Backward, OwnProbe
from replicheck.guard.step.replay import Recompute
from replicheck.guard.step.state import StateDigests
from replicheck.guard.transport.records import ProbePayload, StepRow


class RowBuilder:
    """Builds this rank's contribution to the step's all-gather (the ring exchange runs here)."""

    def __init__(
        self,
        ring: Ring,
        mode: Mode,
        health: GradStats,
        fail: StepFailure,
        recompute: Recompute,
        scaler: torch.amp.GradScaler | None,
        state: StateDigests,
        calibrating: Callable[[], bool],
        precision: Callable[[], int] = lambda: 0,
    ) -> None:
        self._ring, self._mode = ring, mode
        self._health, self._fail, self._recompute, self._scaler = health, fail, recompute, scaler
        self._comm = fail.comm
        self._state = state
        self._calibrating = calibrating
        """Whether tolerant mode still measures its noise (the judge knows)."""
        self._precision = precision
        """Tolerant mode: the code of the precision this rank's tolerances are for."""

    def row(
        self, s: int, done: Backward, own: OwnProbe | None, check_replicas: bool
    ) -> tuple[StepRow[Any, Any], LocalView | None]:
        """This rank's row of step ``s`` and, on a verification step, what it knows of the probes."""
        # Device tensors throughout: the row reaches the host once, after the all-gather.
        local_norm, reduced = self._health.local_norm(), self._health.reduced_digest()
        if self._scaler is not None and isinstance(local_norm, torch.Tensor):
            local_norm = local_norm / scaling.scale_tensor(self._scaler, local_norm.device)  # unscaled
        weights: torch.Tensor | int = 0
        opt: torch.Tensor | int = 0
        if check_replicas:
            weights, opt = self._state.both()
        row = StepRow(loss=done.loss, local_norm=local_norm, reduced=reduced, weights=weights, optimizer=opt)
        view: LocalView | None = None
        if own is not None:
            view, distance, noise = self._verify_pair(s, own.payload)
            row = dataclasses.replace(
                row, verified=True, pair_distance=distance, noise=noise, precision=self._precision()
            )
        # Read after the replay: an error there is this rank's failure too.
        return dataclasses.replace(row, failed=self._fail.failed), view

    def _verify_pair(self, s: int, own: ProbePayload) -> tuple[LocalView | None, float, float]:
        """Send our probe to our verifier, replay our source's probe; return the comparison.

        A rank that failed in this step sends ``None`` instead of its probe (it may have none), and
        its verifier replays nothing: the failed column of the step's row stops every rank."""
        verifier, source = self._ring.verifier_of(self._comm.rank), self._ring.source_of(self._comm.rank)
        message = None if self._fail.failed else own.encode()
        got = self._comm.exchange([(verifier, message)], [source])[source]
        if got is None:
            return None, 0.0, 0.0
        received = ProbePayload.decode(got)
        replayed = self._fail.attempt(lambda: self._recompute.payload(received, s))
        mode = self._mode
        if replayed is None:  # the error rides in the step's row and stops every rank
            return LocalView(own=own, received=received, replayed=received.result), 0.0, 0.0
        distance = compare(received.result, replayed, mode, math.inf).distance
        noise = 0.0
        if mode == "tolerant" and self._calibrating():
            # Two fresh replays of our own probe, not the probe itself: a fault in the probe
            # (the very thing under test) must not enter the noise it is judged against.
            first = self._fail.attempt(lambda: self._recompute.payload(own, s))
            second = self._fail.attempt(lambda: self._recompute.payload(own, s))
            if first is not None and second is not None:
                noise = compare(first, second, mode, math.inf).distance
        return LocalView(own=own, received=received, replayed=replayed), distance, noise
