"""The guard: one optimizer step, checked, and stopped before a corrupted update is applied."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck import fingerprint as fp
from replicheck.guard import replicas, scaling, sharded
from replicheck.guard.attribution import LocalView, Replayer
from replicheck.guard.batch import batch_size
from replicheck.guard.comm import Comm
from replicheck.guard.config import GuardConfig
from replicheck.guard.context import running
from replicheck.guard.determinism import prepare_cublas
from replicheck.guard.errors import (
    BatchError,
    CorruptionDetected,
    GuardConfigError,
    GuardError,
    UpdateReplayError,
)
from replicheck.guard.failure import StepFailure
from replicheck.guard.health import GradHealth, ReducedHook
from replicheck.guard.judge import StepJudge
from replicheck.guard.lockstep import Lockstep
from replicheck.guard.loss import LossFn, unpack
from replicheck.guard.passes import Backward, OwnProbe, StepPasses
from replicheck.guard.probe import (
    Fingerprinter,
    Recompute,
    buffers_restored,
    compare,
)
from replicheck.guard.report import IncidentBuilder
from replicheck.guard.ring import Ring
from replicheck.guard.rng import forked_rng
from replicheck.guard.runtime import RuntimeInfo
from replicheck.guard.support import (
    check_loss_fn,
    check_model,
    check_optimizer,
    step_gate,
    unwrap_compiled,
)
from replicheck.guard.update import REPLAYABLE, UpdateReplay, replayable
from replicheck.guard.verdict import Finding
from replicheck.guard.wire import HostRow, ProbePayload, StepRow
from replicheck.incident import NodeIdentity

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


class Guard:
    """Owns one optimizer step of a (DDP) training job and checks it for silent corruption.

    ``loss_fn(module, batch)`` returns the scalar loss (its kind declared by
    ``GuardConfig.loss_reduction``) or a :class:`~replicheck.guard.LossSum`; it is called with
    the DDP wrapper for training passes and with the bare module for replays. ``scaler`` (fp16
    training) is the job's ``torch.amp.GradScaler``: the guard scales each backward with it and
    steps through it (:mod:`replicheck.guard.scaling`). With world size 1 a
    verification re-executes the probe on the same device, which catches transient faults only.
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
    ) -> None:
        cfg = config if config is not None else GuardConfig()
        if not isinstance(cfg, GuardConfig):
            raise GuardConfigError("config must be a GuardConfig")
        self._config = cfg
        model = unwrap_compiled(model)
        check_loss_fn(loss_fn)
        check_optimizer(optimizer)
        self._model, self._optimizer, self._loss_fn = model, optimizer, loss_fn
        self._scaler = scaling.checked_scaler(scaler)
        self._ddp_model = model if isinstance(model, DistributedDataParallel) else None
        self._module: torch.nn.Module = self._ddp_model.module if self._ddp_model is not None else model
        check_model(self._ddp_model, self._module)
        self._layout = sharded.ShardLayout.of(model) if sharded.is_sharded(model) else None
        self._comm = Comm(self._ddp_model.process_group if self._ddp_model is not None else None)
        named = self._checked_params()
        self._params = [p for _, p in named]
        self._device = sharded.local(self._params[0]).device
        prepare_cublas(self._device, cfg.use_deterministic)

        identity, job_id = _identity(node, cfg.job_id)
        self._nodes: tuple[NodeIdentity, ...] = tuple(self._comm.gather_objects(identity))
        self._ring = Ring.build([n.name for n in self._nodes])

        self._fingerprinter = Fingerprinter(cfg.mode, cfg.sketch_k, cfg.sketch_block)
        self._recompute = Recompute(
            self._module, loss_fn, self._params, self._fingerprinter, cfg.use_deterministic
        )
        self._health: GradHealth | sharded.GradTap = (
            GradHealth(self._comm.group, digest_reduced=cfg.check_reduced and self.world_size > 1)
            if self._layout is None
            else sharded.GradTap(
                model,
                digest_reduced=cfg.check_reduced and self._layout.replicas > 1,
                check_scatter=cfg.check_reduced and self._layout.replicas == 1 and self.world_size > 1,
            )
        )
        self._judge = StepJudge(
            cfg,
            self._comm,
            self._ring,
            [n.name for n in self._nodes],
            self._recompute,
            self._device,
            digest_reduced=self._health.digest_reduced,
            scatter_checked=isinstance(self._health, sharded.GradTap) and self._health.scatter is not None,
            loss_scale=self._scaler.get_scale if self._scaler is not None else None,
            replica_groups=self._layout.groups_of(self.world_size) if self._layout is not None else None,
        )
        self._fail = StepFailure(
            self._comm, optimizer, self._ddp_model, sharded=model if self._layout is not None else None
        )
        if isinstance(self._health, sharded.GradTap):
            self._recompute.lockstep = Lockstep(self._comm, self._health, model, self._params)
            self._fail.hooked = True  # the tap sees every gradient before its reduce-scatter
        else:
            self._health.peer_failed = self._fail.flags.any_failed
            self._fail.hooked = self._install_comm_hook(self._health)
        self._updates = self._update_replay(optimizer)
        if cfg.mode == "exact" and not cfg.use_deterministic:
            log.warning("exact mode without deterministic kernels: a replay may differ by kernel noise")
        self._gate = step_gate(optimizer)
        self._passes = StepPasses(
            config=cfg,
            model=model,
            loss_fn=loss_fn,
            params=self._params,
            fail=self._fail,
            recompute=self._recompute,
            fingerprinter=self._fingerprinter,
            health=self._health,
            scaler=self._scaler,
            rank=self.rank,
        )
        if self.world_size == 1:
            warnings.warn(
                "replicheck: world size 1, so a verification re-runs the probe on the same device: "
                "only transient faults can be caught (a persistent fault gives the same wrong answer "
                "twice). Run with 2 or more ranks to catch persistent faults.",
                stacklevel=2,
            )
        self._next_step = cfg.start_step
        # Whether any two ranks hold the same state to compare (not so under plain FSDP2).
        self._replicated = self.world_size > 1 and (self._layout is None or self._layout.replicas > 1)
        self._needs_rebuild = (
            self._ddp_model is not None and cfg.start_step > 0 and cfg.rebuild_buckets_on_resume
        )
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

    def _checked_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters the guard checks, after refusing a model it cannot guard."""
        if self._comm.world_size > 1 and self._ddp_model is None and self._layout is None:
            raise GuardConfigError(
                "with world size > 1 the model must be wrapped in DistributedDataParallel or sharded "
                "with fully_shard (FSDP2, HSDP)"
            )
        named = fp.named_weights(self._module, "trainable")
        if not named:
            raise GuardConfigError("the model has no trainable parameters")
        return named

    def _update_replay(self, optimizer: torch.optim.Optimizer) -> UpdateReplay | None:
        """Plain FSDP2: the ring's replay of each rank's optimizer update (no replica holds it)."""
        if self._layout is None or self._layout.replicas > 1 or self.world_size < 2:
            return None
        if not self._config.replay_update:
            return None
        if not replayable(optimizer):
            log.warning(
                "plain FSDP2 with %s: its update cannot be replayed shard by shard, so a corrupted "
                "optimizer update goes undetected (use HSDP with 3+ replica groups, or one of the "
                "elementwise torch optimizers: %s)",
                type(optimizer).__name__,
                ", ".join(c.__name__ for c in REPLAYABLE),
            )
            return None
        return UpdateReplay(optimizer, self._comm, self._ring)

    def _install_comm_hook(self, health: GradHealth) -> bool:
        """Check gradients inside DDP's all-reduce when the hook slot is free."""
        if self._ddp_model is None:
            return False
        try:
            self._ddp_model.register_comm_hook(None, self._fail.buckets.wrap(health.comm_hook))
        except RuntimeError as exc:
            # Falling back would lose which rank produced a bad local gradient: refuse instead.
            raise GuardConfigError(
                "the DDP model already has a communication hook (register_comm_hook, or DDP's "
                "mixed_precision option); the guard needs that slot to check each rank's gradient "
                "before the all-reduce. Remove the hook (for gradient compression, none is supported "
                f"with the guard yet). DDP said: {exc}"
            ) from None
        return True

    def _weights_digest(self) -> torch.Tensor:
        """Every parameter (frozen ones too) and every buffer replicas share (on the device); this
        rank's shards of them on a sharded model."""
        if self._layout is not None:
            return sharded.weights_digest(self._module, self._config.per_rank_buffers)
        return fp.model_digest_tensor(self._module, "replicated", per_rank=self._config.per_rank_buffers)

    # -- public -----------------------------------------------------------------------------
    @property
    def config(self) -> GuardConfig:
        """The guard's configuration."""
        return self._config

    @property
    def rank(self) -> int:
        """This process's rank in the guarded job's process group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in the guarded job's process group."""
        return self._comm.world_size

    @property
    def comm(self) -> Comm:
        """Collectives over the guarded job's process group (the checkpoint store uses them)."""
        return self._comm

    @property
    def next_step(self) -> int:
        """Index of the step the next call to :meth:`step` runs."""
        return self._next_step

    def add_reduced_gradient_hook(self, hook: ReducedHook) -> Callable[[], None]:
        """Call ``hook(bucket_index, tensor)`` on each reduced gradient bucket; returns a remover."""
        self._health.reduced_hooks.append(hook)

        def remove() -> None:
            if hook in self._health.reduced_hooks:
                self._health.reduced_hooks.remove(hook)

        return remove

    def check_replicas(self) -> None:
        """Collective: compare weights and optimizer state now; raise CorruptionDetected if they differ."""
        step = self._next_step - 1
        row: StepRow[float, int | torch.Tensor] = StepRow(
            loss=0.0,
            local_norm=0.0,
            reduced=0,
            weights=self._weights_digest(),
            optimizer=self._optimizer_digest(),
        )
        rows = StepRow.decode(self._comm.gather_rows(row.encode(self._device)))
        groups = self._layout.groups_of(self.world_size) if self._layout is not None else None
        findings = replicas.findings([int(r.weights) for r in rows], [int(r.optimizer) for r in rows], groups)
        if findings:
            self._raise(step, findings)

    def step(self, *microbatches: Any) -> StepResult:
        """Run one guarded optimizer step over one batch or several micro-batches."""
        if not microbatches:
            raise BatchError("step() needs at least one batch")
        cfg = self._config
        s = self._next_step
        sizes = [batch_size(mb) for mb in microbatches]
        verify = s % cfg.verify_every == 0
        check_replicas = self._replicated and cfg.weights_every > 0 and s % cfg.weights_every == 0
        if self._needs_rebuild:
            self._rebuild_buckets(microbatches[0])
        if self._recompute.lockstep is not None:
            self._recompute.lockstep.set_filler(microbatches[0], cfg.probe_size)
        self._optimizer.zero_grad(set_to_none=True)
        self._health.reset()
        self._fail.reset()

        own = (
            self._passes.own_probe(s, microbatches[0], sizes[0], sum(sizes), more=len(sizes) > 1)
            if verify
            else None
        )
        done = self._passes.backward(s, list(microbatches), sizes, own)
        row, view = self._local_row(s, done, own, check_replicas)
        # The step's one device→host transfer: every rank's row, after the all-gather.
        rows = StepRow.decode(self._comm.gather_rows(row.encode(self._device)))
        self._fail.stop(s, [r.failed for r in rows])
        findings = self._judge.evaluate(
            s, rows, check_replicas=check_replicas, view=view, passes=done.passes, replayer=self._replayer
        )
        if findings and self._scaler is not None and scaling.is_overflow(findings, self.world_size):
            return self._skip_overflow(s, rows, check_replicas)
        if findings:
            self._raise(s, findings)
        updates = self._updates if verify else None
        scaler_state = self._scaler.state_dict() if updates is not None and self._scaler is not None else None
        if updates is not None:
            updates.arm()
        self._gate.open = True
        try:
            with running(s, "optimizer"):
                if self._scaler is not None:
                    self._scaler.step(self._optimizer)
                    self._scaler.update()
                else:
                    self._optimizer.step()
        finally:
            self._gate.open = False
        if updates is not None:
            self._check_update(s, updates, scaler_state)
        if verify:
            self.last_verified_step = s
            log.info("step %d verified (replay) on rank %d", s, self.rank)
        if check_replicas:
            log.info("step %d weights and optimizer state agree across %d ranks", s, self.world_size)
        self._next_step = s + 1
        return StepResult(
            loss=float(rows[self.rank].loss), step=s, verified=verify, replicas_checked=check_replicas
        )

    def _check_update(self, s: int, updates: UpdateReplay, scaler_state: dict[str, Any] | None) -> None:
        """Plain FSDP2: the ring replays every rank's update; a disputed one is undone on every
        rank (with the scaler's update) before the incident is raised."""
        try:
            with running(s, "optimizer"):
                finding = updates.check(s)
        except UpdateReplayError:
            self._undo_update(updates, scaler_state)
            raise
        if finding is None:
            return
        self._undo_update(updates, scaler_state)
        self._raise(s, [finding])

    def _undo_update(self, updates: UpdateReplay, scaler_state: dict[str, Any] | None) -> None:
        updates.restore()
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(scaler_state)

    def _skip_overflow(self, s: int, rows: Sequence[HostRow], check_replicas: bool) -> StepResult:
        """Every rank skips step ``s`` as the loss scaler does (:mod:`replicheck.guard.scaling`)."""
        scaler = self._scaler
        if scaler is None:
            raise GuardError("internal: an overflow skip without a scaler")
        if not scaling.skip(scaler, self._optimizer):
            log.warning("step %d: the scaler saw no overflow in the reduced gradient; step skipped anyway", s)
        log.info("step %d: loss-scale overflow reproduced, skipped on every rank (scale lowered)", s)
        self._next_step = s + 1
        return StepResult(
            loss=float(rows[self.rank].loss),
            step=s,
            verified=False,
            replicas_checked=check_replicas,
            skipped=True,
        )

    def _optimizer_digest(self) -> torch.Tensor:
        """The optimizer state's digest, with the loss scaler's state when there is one."""
        digest = (
            sharded.optimizer_digest(self._optimizer)
            if self._layout is not None
            else fp.optimizer_digest_tensor(self._optimizer)
        )
        if self._scaler is None:
            return digest
        return fp.combine(torch.stack([digest, scaling.state_digest(self._scaler).to(digest.device)]))

    # -- the step's phases ------------------------------------------------------------------
    def _local_row(
        self, s: int, done: Backward, own: OwnProbe | None, check_replicas: bool
    ) -> tuple[StepRow[Any, Any], LocalView | None]:
        """This rank's contribution to the step's all-gather (the ring exchange runs here)."""
        # Device tensors throughout: the row reaches the host once, after the all-gather.
        loss = done.loss
        local_norm, reduced = self._health.local_norm(), self._health.reduced_digest()
        if self._scaler is not None and isinstance(local_norm, torch.Tensor):
            local_norm = local_norm / scaling.scale_tensor(self._scaler, local_norm.device)  # unscaled
        weights: torch.Tensor | int = self._weights_digest() if check_replicas else 0
        opt: torch.Tensor | int = self._optimizer_digest() if check_replicas else 0
        row = StepRow(loss=loss, local_norm=local_norm, reduced=reduced, weights=weights, optimizer=opt)
        view: LocalView | None = None
        if own is not None:
            view, distance, noise = self._verify_pair(s, own.payload)
            row = dataclasses.replace(row, verified=True, pair_distance=distance, noise=noise)
        # Read after the replay: an error there is this rank's failure too.
        return dataclasses.replace(row, failed=self._fail.failed), view

    def _replayer(self, s: int) -> Replayer:
        return lambda payload: self._recompute.payload(payload, s)

    def _verify_pair(self, s: int, own: ProbePayload) -> tuple[LocalView, float, float]:
        """Send our probe to our verifier, replay our source's probe; return the comparison."""
        verifier, source = self._ring.verifier_of(self.rank), self._ring.source_of(self.rank)
        received = ProbePayload.decode(self._comm.exchange([(verifier, own.encode())], [source])[source])
        replayed = self._fail.attempt(lambda: self._recompute.payload(received, s))
        mode = self._config.mode
        if replayed is None:  # the error rides in the step's row and stops every rank
            return LocalView(own=own, received=received, replayed=received.result), 0.0, 0.0
        distance = compare(received.result, replayed, mode, math.inf).distance
        noise = 0.0
        if mode == "tolerant" and self._judge.calibrating:
            # Two fresh replays of our own probe, not the probe itself: a fault in the probe
            # (the very thing under test) must not enter the noise it is judged against.
            first = self._fail.attempt(lambda: self._recompute.payload(own, s))
            second = self._fail.attempt(lambda: self._recompute.payload(own, s))
            if first is not None and second is not None:
                noise = compare(first, second, mode, math.inf).distance
        return LocalView(own=own, received=received, replayed=replayed), distance, noise

    def _raise(self, s: int, findings: list[Finding]) -> NoReturn:
        self._optimizer.zero_grad(set_to_none=True)
        if isinstance(self._health, sharded.GradTap) and self._health.units:
            # A sharded fingerprint has one entry per layer group, in the order backward made them.
            self._reporter = dataclasses.replace(self._reporter, param_names=tuple(self._health.units))
        incident = self._reporter.build(
            s, findings, self.last_verified_step, time=self._reporter.raised_at(self._comm)
        )
        try:
            self._reporter.write(incident)
        except OSError as exc:
            # The step is stopped on every rank whether or not the record reached the disk.
            raise CorruptionDetected(incident, write_error=str(exc)) from exc
        raise CorruptionDetected(incident)

    def _rebuild_buckets(self, batch: Any) -> None:
        """One synced backward, gradients discarded, so DDP settles its bucket layout."""
        self._needs_rebuild = False
        with (
            forked_rng(p.device for p in self._params),
            running(self._next_step, "rebuild"),
            buffers_restored(self._module),
        ):
            loss, _ = unpack(self._loss_fn(self._model, batch))
            _backward(loss)
        self._optimizer.zero_grad(set_to_none=True)
        self._health.reset()


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
