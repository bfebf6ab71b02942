"""The step's verdict: findings from every rank's row, resolved to a suspect where they can be.

Every rank evaluates the same gathered rows, so every rank reaches the same findings and enters
the same follow-up collectives (arbitration, gradient re-runs) or none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from replicheck.guard.attribution.calibration import Calibration
from replicheck.guard.attribution.resolve import (
    Criterion,
    LocalView,
    PairOutcome,
    Replayer,
    RerunFailed,
    resolve_replay,
)
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks import replicas
from replicheck.guard.config import GuardConfig
from replicheck.guard.step.precision import ToleranceState
from replicheck.guard.step.replay import Recompute
from replicheck.guard.transport.batch import to_device
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import BackwardPass, GradientWork, Rows

ReducedFinding = Callable[[Sequence[int], "Sequence[Sequence[int]] | None"], "Finding | None"]
"""The reduced-gradient finding from every rank's row (the parallelism's gradient statistics)."""


class StepJudge:
    """Turns a step's rows into findings; holds the tolerant mode's calibrated noise."""

    def __init__(
        self,
        config: GuardConfig,
        comm: Comm,
        ring: Ring,
        nodes: Sequence[str],
        recompute: Recompute,
        device: torch.device,
        *,
        reduced_finding: ReducedFinding,
        loss_scale: Callable[[], float] | None = None,
        replica_groups: Sequence[Sequence[int]] | None = None,
        tolerances: ToleranceState | None = None,
    ) -> None:
        self._config, self._comm, self._ring = config, comm, ring
        self._nodes = list(nodes)
        self._recompute, self._device = recompute, device
        self._reduced_finding = reduced_finding
        """Reads the rows' ``reduced`` column (a digest, or each rank's own verdict)."""
        self._loss_scale = loss_scale
        self._groups = replica_groups
        """Ranks that hold the same state (None: every rank, as in DDP)."""
        self._tolerances = tolerances
        """Tolerant mode: this rank's precision and the tolerances that follow."""
        self.calibration = Calibration()
        """Tolerant mode: the noise measured so far (part of the guard's state)."""

    @property
    def calibrating(self) -> bool:
        """Tolerant mode is still measuring its noise (the first verifications of the run)."""
        return self.calibration.verifications < self._config.calibration_verifications

    def evaluate(
        self,
        s: int,
        rows: Rows,
        *,
        check_replicas: bool,
        view: LocalView | None,
        passes: Sequence[BackwardPass],
        replayer: Callable[[int], Replayer],
    ) -> list[Finding]:
        """Every finding of step ``s``: gradient health, reduced gradients, replicas, replay.

        A re-run that raised on some rank raises :class:`RerunFailed` on every rank, holding
        the findings made before it and the one it left unresolved."""
        findings: list[Finding] = []
        try:
            self._evaluate(s, rows, findings, check_replicas, view, passes, replayer)
        except RerunFailed as exc:
            exc.findings[:0] = findings
            raise
        return findings

    def _evaluate(
        self,
        s: int,
        rows: Rows,
        findings: list[Finding],
        check_replicas: bool,
        view: LocalView | None,
        passes: Sequence[BackwardPass],
        replayer: Callable[[int], Replayer],
    ) -> None:
        bound = self._config.grad_norm_bound
        norms = rows.column("local_norm")
        bad = [r for r, n in enumerate(norms) if not replicas.healthy(n, bound)]
        if bad:
            # With a loss scaler the passes ran scaled: re-runs do too, and report unscaled norms
            # (as the rows do), so the bound means the same in both.
            scale = self._loss_scale() if self._loss_scale is not None else 1.0
            scaled = [dataclasses.replace(p, weight=p.weight * scale) for p in passes]
            findings.append(
                replicas.gradient_finding(
                    self._comm,
                    bad,
                    norms,
                    bound,
                    lambda: self._recompute.gradient_norm(scaled, s) / scale,
                    nodes=self._nodes,
                    work=GradientWork(passes=tuple(scaled)),
                    rerun_elsewhere=lambda w: (
                        self._recompute.gradient_norm(_on_device(w, self._device), s) / scale
                    ),
                    together=self._recompute.together,
                    step=s,
                )
            )
        f = self._reduced_finding(rows.column("reduced"), self._groups)
        if f is not None:
            findings.append(f)
        if check_replicas:
            findings.extend(replicas.findings(rows.column("weights"), rows.column("optimizer"), self._groups))
        if view is not None:
            f = self._replay_finding(rows, view, replayer(s))
            if f is not None:
                findings.append(f)

    def _criterion(self, rows: Rows) -> Criterion:
        """How the step's pairs are judged; tolerant mode folds this step's noise into the
        calibration first, while it calibrates."""
        cfg = self._config
        if cfg.mode != "tolerant":
            return Criterion(mode=cfg.mode, threshold=0.0)
        assert self._tolerances is not None, "tolerant mode has tolerances"
        tol = self._tolerances.agreed(rows.column("precision"))
        if self.calibrating:
            self.calibration = self.calibration.fold(
                rows.column("noise"), rows.column("pair_distance"), self._ring
            )
        threshold = self.calibration.threshold(
            margin=cfg.tolerance_margin, floor=tol.floor, ceiling=tol.ceiling
        )
        return Criterion(
            mode="tolerant",
            threshold=threshold,
            context={
                **tol.to_evidence(),
                "threshold": threshold,
                "calibrated_noise": self.calibration.noise,
                "calibration": self.calibration.to_dict(),
            },
        )

    def _replay_finding(self, rows: Rows, view: LocalView, replay: Replayer) -> Finding | None:
        criterion = self._criterion(rows)
        distances = rows.column("pair_distance")
        if all(criterion.accepts(d) for d in distances):
            return None  # a clean step builds nothing per rank
        pairs = []
        for ver, d in enumerate(distances):
            src = self._ring.source_of(ver)
            pairs.append(
                PairOutcome(
                    source=src,
                    verifier=ver,
                    source_node=self._nodes[src],
                    verifier_node=self._nodes[ver],
                    distance=d,
                    agree=criterion.accepts(d),
                )
            )
        return resolve_replay(
            comm=self._comm,
            ring=self._ring,
            pairs=pairs,
            view=view,
            replay=replay,
            criterion=criterion,
            together=self._recompute.together,
        )


def _on_device(work: GradientWork, device: torch.device) -> list[BackwardPass]:
    """Another rank's passes of a step, their batches moved to this rank's compute device."""
    return [dataclasses.replace(p, batch=to_device(p.batch, device)) for p in work.passes]
