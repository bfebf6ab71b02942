"""The guard: one optimizer step, checked, and stopped before a corrupted update is applied.

How the job is parallel is the :class:`~replicheck.guard.parallel.base.Parallelism`'s business:
the guard asks it and holds no branch on the model's type (``docs/architecture.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from replicheck.guard.attribution.calibration import Calibration
from replicheck.guard.attribution.resolve import Replayer, RerunFailed
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks import replicas, scaling
from replicheck.guard.checks.health import ReducedHook
from replicheck.guard.config import GuardConfig
from replicheck.guard.context import running
from replicheck.guard.errors import (
    BatchError,
    CorruptionDetected,
    GuardConfigError,
    GuardMisuseError,
    PeerFailed,
)
from replicheck.guard.loss import LossFn, unpack
from replicheck.guard.modules import unwrap
from replicheck.guard.parallel.base import Parallelism, detect
from replicheck.guard.runtime import RuntimeInfo
from replicheck.guard.step.apply import GradientEdit, UpdateApplier
from replicheck.guard.step.determinism import prepare_cublas
from replicheck.guard.step.failure import StepFailure
from replicheck.guard.step.judge import StepJudge
from replicheck.guard.step.passes import StepPasses
from replicheck.guard.step.precision import ToleranceState
from replicheck.guard.step.replay import Fingerprinter, Recompute, buffers_restored
from replicheck.guard.step.report import IncidentBuilder
from replicheck.guard.step.rng import forked_rng
from replicheck.guard.step.state import StateDigests
from replicheck.guard.step.support import check_loss_fn, check_model, check_optimizer, resolve_optimizer
from replicheck.guard.step.verify import RowBuilder
from replicheck.guard.tolerance import Tolerance
from replicheck.guard.tolerance import code as precision_code
from replicheck.guard.transport.batch import batch_size
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import StepRow
from replicheck.incident import Incident, NodeIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Guard.step` returns for a step that ended without an incident."""

    loss: float
    """This rank's loss for the step, normalised as ``loss_fn`` says (a ``LossSum``: total over
    the step's items divided by their count)."""
    step: int
    """Index of the step just completed."""
    verified: bool
    """True when this step ran the ring replay (and it passed)."""
    replicas_checked: bool = False
    """True when weights and optimizer state were compared across replicas on this step."""
    skipped: bool = False
    """True when the loss scaler overflowed and the step was skipped on every rank, as the scaler
    does: no update applied, the scale lowered (only with ``scaler=``)."""
    grad_norm: float | None = None
    """With ``GuardConfig.max_grad_norm``: the total norm of the reduced gradient before clipping
    (what ``clip_grad_norm_`` returns; after a loss scaler's ``unscale_`` and the gradient edits),
    the same on every rank. ``None`` without clipping, or when the step was skipped."""


class Guard:
    """Owns one optimizer step of a distributed training job and checks it for silent corruption.

    ``loss_fn(module, batch)`` returns the scalar loss (its kind declared by
    ``GuardConfig.loss_reduction``) or a :class:`~replicheck.guard.LossSum`; it is called with
    the wrapper (DDP) for training passes and with the bare module for replays. ``scaler`` (fp16
    training) is the job's ``torch.amp.GradScaler``: the guard scales each backward with it and
    steps through it (:mod:`replicheck.guard.checks.scaling`). ``parallelism`` says how the job is
    parallel when no built-in kind claims the model (DDP, ``fully_shard``, one process). With
    world size 1 a verification re-executes the probe on the same device, which catches transient
    faults only.

    ``optimizer`` is a ``torch.optim.Optimizer``, or a wrapper that holds one in ``.optimizer``
    and delegates to it (Accelerate's ``AcceleratedOptimizer``): the guard then steps the wrapped
    optimizer itself (a wrapper with a loss scaler of its own is refused: pass its ``.optimizer``
    and ``scaler=``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: GuardConfig | None = None,
        node: str | NodeIdentity | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        parallelism: Parallelism | None = None,
    ) -> None:
        cfg = config if config is not None else GuardConfig()
        if not isinstance(cfg, GuardConfig):
            raise GuardConfigError("config must be a GuardConfig")
        self._config = cfg
        check_loss_fn(loss_fn)
        optimizer = resolve_optimizer(optimizer, scaler)
        check_optimizer(optimizer)
        self._optimizer, self._loss_fn = optimizer, loss_fn
        self._scaler = scaling.checked_scaler(scaler)
        check_model(unwrap(model))
        par = parallelism if parallelism is not None else detect(model)
        self._par = par
        named = par.named_params()
        self._params = [p for _, p in named]
        self._device = par.device
        prepare_cublas(self._device, cfg.use_deterministic)

        identity, job_id = _identity(node, cfg.job_id)
        self._nodes: tuple[NodeIdentity, ...] = tuple(self.comm.gather_objects(identity))
        self._ring = Ring.build([n.name for n in self._nodes])

        self._fail = StepFailure(optimizer, par)
        self._health = par.install(cfg)
        self._tolerances = ToleranceState(cfg, par.module, self._device, self._params, self.comm.rank)
        tolerances = self._tolerances
        fingerprinter = Fingerprinter(cfg.mode, cfg.sketch_k, lambda: tolerances.tolerance().sketch_block)
        self._recompute = Recompute(
            par, loss_fn, self._params, fingerprinter, cfg.use_deterministic, cfg.probe_attention
        )
        self._judge = StepJudge(
            cfg,
            self.comm,
            self._ring,
            [n.name for n in self._nodes],
            self._recompute,
            self._device,
            reduced_finding=self._health.reduced_finding,
            loss_scale=self._scaler.get_scale if self._scaler is not None else None,
            replica_groups=par.replica_groups,
            tolerances=self._tolerances,
        )
        if cfg.mode == "exact" and not cfg.use_deterministic:
            log.warning("exact mode without deterministic kernels: a replay may differ by kernel noise")
        self._apply = UpdateApplier(
            optimizer,
            self._scaler,
            par.update_check(optimizer, self._ring, cfg),
            self._raise,
            params=self._params,
            max_grad_norm=cfg.max_grad_norm,
        )
        self._passes = StepPasses(
            config=cfg,
            parallelism=par,
            loss_fn=loss_fn,
            params=self._params,
            fail=self._fail,
            recompute=self._recompute,
            fingerprinter=fingerprinter,
            health=self._health,
            scaler=self._scaler,
        )
        self._state = StateDigests(par, optimizer, self._scaler, cfg.per_rank_buffers)
        judge = self._judge
        self._rows = RowBuilder(
            self._ring,
            cfg.mode,
            self._health,
            self._fail,
            self._recompute,
            self._scaler,
            self._state,
            lambda: judge.calibrating,
            precision=(lambda: precision_code(tolerances.tolerance().precision))
            if cfg.mode == "tolerant"
            else (lambda: 0),
        )
        if self.world_size == 1:
            warnings.warn(
                "replicheck: world size 1, so a verification re-runs the probe on the same device: "
                "only transient faults can be caught (a persistent fault gives the same wrong answer "
                "twice). Run with 2 or more ranks to catch persistent faults.",
                stacklevel=2,
            )
        self._next_step = cfg.start_step
        self._needs_rebuild = par.rebuilds_on_resume and cfg.start_step > 0 and cfg.rebuild_buckets_on_resume
        self._stepped = False  # whether this guard has run a step (the fresh-start warning)
        self._in_step = False  # inside step(): its state may not be replaced then
        self.last_verified_step: int | None = cfg.resume_verified_step
        """The newest step whose verification passed (a resumed job may set it from its checkpoint)."""
        self._reporter = IncidentBuilder(
            job_id=job_id,
            rank=self.rank,
            nodes=self._nodes,
            param_names=tuple(n for n, _ in named),
            ring=self._ring.order,
            mode=cfg.mode,
            incident_dir=cfg.incident_dir,
            attempt=RuntimeInfo.attempt_from_env(),
            incident_mode=cfg.incident_mode,
        )

    # -- public -----------------------------------------------------------------------------
    @property
    def config(self) -> GuardConfig:
        """The guard's configuration."""
        return self._config

    @property
    def parallelism(self) -> Parallelism:
        """How the guarded job is parallel (the seam every check asks)."""
        return self._par

    @property
    def rank(self) -> int:
        """This process's rank in the guarded job's process group."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in the guarded job's process group."""
        return self.comm.world_size

    @property
    def comm(self) -> Comm:
        """Collectives over the guarded job's process group (the checkpoint store uses them)."""
        return self._par.comm

    @property
    def next_step(self) -> int:
        """Index of the step the next call to :meth:`step` runs."""
        return self._next_step

    @property
    def tolerance(self) -> Tolerance | None:
        """Tolerant mode: the tolerances in force (block, floor, ceiling and the precision they
        are for); ``None`` in exact mode and before an ``auto`` job's first forward."""
        if self._config.mode != "tolerant" or self._tolerances.precision is None:
            return None
        return self._tolerances.tolerance()

    @property
    def threshold(self) -> float | None:
        """Tolerant mode: the threshold a pair is judged by now (the floor raised by calibration);
        ``None`` where :attr:`tolerance` is."""
        tol = self.tolerance
        if tol is None:
            return None
        return self._judge.calibration.threshold(
            margin=self._config.tolerance_margin, floor=tol.floor, ceiling=tol.ceiling
        )

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state, to save beside the model's: the next step, the newest verified
        step and tolerant mode's calibration (plain Python values)."""
        return {
            "format": _STATE_FORMAT,
            "next_step": self._next_step,
            "last_verified_step": self.last_verified_step,
            "calibration": self._judge.calibration.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: steps continue from the saved ones and tolerant mode keeps
        the noise it measured instead of calibrating again.

        Before the first step of a resumed run, or at a step boundary of a live run (torchft's live
        recovery hands a joining replica group a healthy group's state between two steps): the next
        :meth:`step` runs the loaded ``next_step``. Raises :class:`GuardConfigError` for a state
        that is not one, and :class:`GuardMisuseError` from inside a step (a loss function or a
        hook), changing nothing either way."""
        if self._in_step:
            raise GuardMisuseError(
                "guard.load_state_dict() called during guard.step(): load the guard's state before "
                "the first step or between two steps"
            )
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise GuardConfigError(f"not a replicheck guard state (format {_STATE_FORMAT!r} expected)")
        next_step, verified = state.get("next_step"), state.get("last_verified_step")
        if not isinstance(next_step, int) or isinstance(next_step, bool) or next_step < 0:
            raise GuardConfigError(f"guard state: next_step must be an int >= 0, got {next_step!r}")
        if verified is not None and (not isinstance(verified, int) or not 0 <= verified < next_step):
            raise GuardConfigError(
                f"guard state: last_verified_step must be None or an int below next_step, got {verified!r}"
            )
        try:
            calibration = Calibration.from_dict(state.get("calibration") or {})
        except ValueError as exc:
            raise GuardConfigError(f"guard state: {exc}") from exc
        self._next_step = next_step
        self.last_verified_step = verified
        self._judge.calibration = calibration
        if not self._stepped and next_step > 0:
            # A resumed run settles DDP's bucket layout as start_step > 0 would (bit-exact resume).
            self._needs_rebuild = self._par.rebuilds_on_resume and self._config.rebuild_buckets_on_resume

    def add_reduced_gradient_hook(self, hook: ReducedHook) -> Callable[[], None]:
        """Call ``hook(bucket_index, tensor)`` on each reduced gradient bucket; returns a remover."""
        self._health.reduced_hooks.append(hook)

        def remove() -> None:
            if hook in self._health.reduced_hooks:
                self._health.reduced_hooks.remove(hook)

        return remove

    def add_gradient_edit(self, edit: GradientEdit) -> Callable[[], None]:
        """Run ``edit(params)`` on every rank on the reduced gradient of each step that passed its
        checks, before clipping (``GuardConfig.max_grad_norm``) and the optimizer step, so the
        update check (FSDP2's replay) sees the edited gradient; returns a remover.

        ``params`` are the guard's trainable parameters (under FSDP2 their ``.grad`` are this
        rank's DTensor shards); ``edit`` changes ``.grad`` in place, under ``torch.no_grad()``,
        after a loss scaler's ``unscale_``. Edits run in the order they were added. Under FSDP2
        an edit that reads the whole gradient (a norm) must use DTensor operations (collectives,
        then run by every rank alike).
        """
        if not callable(edit):
            raise GuardConfigError(f"a gradient edit must be callable, got {type(edit).__name__}")
        edits = self._apply.edits
        edits.append(edit)

        def remove() -> None:
            if edit in edits:
                edits.remove(edit)

        return remove

    def check_replicas(self) -> None:
        """Collective: compare weights and optimizer state now; raise CorruptionDetected if they differ."""
        step = self._next_step - 1
        row: StepRow[float, int | torch.Tensor] = StepRow(
            loss=0.0,
            local_norm=0.0,
            reduced=0,
            weights=self._state.weights(),
            optimizer=self._state.optimizer(),
        )
        rows = StepRow.decode(self.comm.gather_rows(row.encode(self._device)))
        findings = replicas.findings(
            rows.column("weights"), rows.column("optimizer"), self._par.replica_groups
        )
        if findings:
            self._raise(step, findings)

    def step(self, *microbatches: Any) -> StepResult:
        """Run one guarded optimizer step over one batch or several micro-batches."""
        self._in_step = True
        try:
            return self._step(microbatches)
        finally:
            self._in_step = False

    def _step(self, microbatches: tuple[Any, ...]) -> StepResult:
        if not microbatches:
            raise BatchError("step() needs at least one batch")
        misuse = self._par.sync_off()
        if misuse is not None:
            # Local state the job's own code set alike on every rank: every rank refuses here,
            # before any pass or collective.
            raise GuardMisuseError(
                f"guard.step() called while {misuse}: the guard runs gradient accumulation itself. "
                "Pass the step's micro-batches to one call, guard.step(mb1, mb2, ...), outside "
                "no_sync() / with gradient sync on."
            )
        cfg = self._config
        s = self._next_step
        if not self._stepped:
            self._stepped = True
            self._warn_fresh_start(s)
        sizes = [batch_size(mb) for mb in microbatches]
        verify = s % cfg.verify_every == 0
        check_replicas = self._par.replicated and cfg.weights_every > 0 and s % cfg.weights_every == 0
        if self._needs_rebuild:
            self._settle_after_resume(microbatches[0])
        self._recompute.begin_step(microbatches[0], cfg.probe_size)
        self._optimizer.zero_grad(set_to_none=True)
        self._health.reset()
        self._fail.reset()

        own = (
            self._passes.own_probe(s, microbatches[0], sizes[0], sum(sizes), more=len(sizes) > 1)
            if verify
            else None
        )
        done = self._passes.backward(s, list(microbatches), sizes, own)
        row, view = self._rows.row(s, done, own, check_replicas)
        # The step's one device→host transfer: every rank's row, after the all-gather.
        rows = StepRow.decode(self.comm.gather_rows(row.encode(self._device)))
        self._fail.stop(s, rows.column("failed"))
        failed: RerunFailed | None = None
        findings: list[Finding] = []
        try:
            findings = self._judge.evaluate(
                s, rows, check_replicas=check_replicas, view=view, passes=done.passes, replayer=self._replayer
            )
        except RerunFailed as exc:
            failed = exc  # raised below, outside the handler (not chained to RerunFailed)
        # Every follow-up pass of this rank is done; some parallelisms' ranks may still owe
        # others theirs (torchft's columns inside a sharded group).
        self._recompute.settle(s)
        if failed is not None:
            self._stop_unresolved(s, failed)
        result = StepResult(
            loss=float(rows[self.rank].loss), step=s, verified=verify, replicas_checked=check_replicas
        )
        if findings and self._scaler is not None and scaling.is_overflow(findings, self.world_size):
            self._apply.skip_overflow(s)
            self._next_step = s + 1
            return dataclasses.replace(result, verified=False, skipped=True)
        if findings:
            self._raise(s, findings)
        grad_norm = self._apply.apply(s, verify)
        result = dataclasses.replace(result, grad_norm=grad_norm) if grad_norm is not None else result
        if verify:
            self.last_verified_step = s
            log.info("step %d verified (replay) on rank %d", s, self.rank)
        if check_replicas:
            log.info("step %d weights and optimizer state agree across %d ranks", s, self.world_size)
        self._next_step = s + 1
        return result

    def _warn_fresh_start(self, s: int) -> None:
        """Step 0 over an optimizer that already has state: a resumed run that forgot the
        guard's state restarts its verification and replica schedule from step 0."""
        if s == 0 and any(self._optimizer.state.values()):
            warnings.warn(
                "replicheck: the guard starts at step 0 but the optimizer already has state (a "
                "resumed run?): the guard's verification and replica-check schedule restarts from "
                "step 0. Restore the guard's own state with guard.load_state_dict(...) (saved by "
                "CheckpointStore.save(guard=...)) or pass GuardConfig(start_step=checkpoint step + 1).",
                UserWarning,
                stacklevel=4,
            )

    def _replayer(self, s: int) -> Replayer:
        return lambda payload: self._recompute.payload(payload, s)

    def _raise(self, s: int, findings: list[Finding]) -> NoReturn:
        incident, write_error = self._record(s, findings)
        raise CorruptionDetected(incident, write_error=write_error)

    def _record(self, s: int, findings: list[Finding]) -> tuple[Incident, str | None]:
        """Collective: the incident of step ``s`` (every rank holds it), written by one rank;
        with why it could not be written, when it could not."""
        self._optimizer.zero_grad(set_to_none=True)
        names = self._par.fingerprint_names()
        if names is not None:
            self._reporter = dataclasses.replace(self._reporter, param_names=names)
        incident = self._reporter.build(
            s, findings, self.last_verified_step, time=self._reporter.raised_at(self.comm)
        )
        try:
            self._reporter.write(incident)
        except OSError as exc:
            # The step is stopped on every rank whether or not the record reached the disk.
            log.error("incident %s not written: %s", incident.id, exc)
            return incident, str(exc)
        return incident, None

    def _stop_unresolved(self, s: int, failed: RerunFailed) -> NoReturn:
        """A re-run of the failure path raised on some rank (every rank is here, after the same
        gather): record the incident as far as it was resolved, then raise the failing rank's
        own error there and PeerFailed, holding the incident, on the others."""
        incident, write_error = self._record(s, failed.findings)
        where = "recorded" if write_error is None else f"NOT written ({write_error})"
        log.error(
            "step %d: a re-run failed on rank(s) %s; incident %s %s", s, failed.ranks, incident.id, where
        )
        if failed.error is not None:
            failed.error.add_note(
                f"replicheck: step {s} stopped on every rank; incident {incident.id} {where}"
            )
            raise failed.error
        raise PeerFailed(s, failed.ranks, incident=incident)

    def _settle_after_resume(self, batch: Any) -> None:
        """One synced backward, gradients discarded, before the first resumed step: the parallelism
        settles what the first backward decides (DDP: its bucket layout, so the reduction order)."""
        self._needs_rebuild = False
        with (
            forked_rng([self._device, *(p.device for p in self._params)]),
            running(self._next_step, "rebuild"),
            buffers_restored(self._par.module),
        ):
            loss, _ = unpack(self._loss_fn(self._par.model, batch))
            _backward(loss)
        self._optimizer.zero_grad(set_to_none=True)
        self._health.reset()


_STATE_FORMAT = "replicheck.guard-state/1"


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave Tensor.backward untyped


def _identity(node: str | NodeIdentity | None, job_id: str | None) -> tuple[NodeIdentity, str]:
    """This process's node and the job id; the environment is read only for what is not given."""
    if node is None:
        env = RuntimeInfo.from_env()
        return env.node, job_id or env.job_id
    identity = NodeIdentity(name=node) if isinstance(node, str) else node
    if job_id is None:
        return identity, RuntimeInfo.from_env().job_id
    return identity, job_id or "local"
