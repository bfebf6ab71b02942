"""The guard: one optimizer step, checked, and stopped before a corrupted update is applied."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import replicas
from replicheck.guard.batch import batch_size, split
from replicheck.guard.comm import Comm
from replicheck.guard.config import GuardConfig
from replicheck.guard.context import running
from replicheck.guard.errors import BatchError, CorruptionDetected, GuardConfigError
from replicheck.guard.followup import LocalView, resolve_replay
from replicheck.guard.health import GradHealth, ReducedHook
from replicheck.guard.probe import (
    Fingerprinter,
    LossFn,
    ProbeResult,
    bits_float,
    buffers_restored,
    compare,
    deterministic,
    float_bits,
    probe_seed,
    replay,
    seeded,
)
from replicheck.guard.report import IncidentBuilder
from replicheck.guard.ring import Ring
from replicheck.guard.verdict import Finding, tolerance
from replicheck.incident import NodeIdentity
from replicheck.guard.runtime import RuntimeInfo

# Columns of the row every rank contributes to the step's single all-gather.
_LOCAL_NORM, _REDUCED, _WEIGHTS, _OPT, _VERIFIED, _PAIR, _NOISE, _LOSS = range(8)
_ROW = 8


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Guard.step` returns for a step whose update was applied."""

    loss: float
    """This rank's loss for the step (mean over all its samples)."""
    step: int
    """Index of the step just completed."""
    verified: bool
    """True when this step ran the ring replay (and it passed)."""
    replicas_checked: bool = False
    """True when weights and optimizer state were compared across replicas on this step."""


class Guard:
    """Owns one optimizer step of a (DDP) training job and checks it for silent corruption.

    ``loss_fn(module, batch)`` returns the scalar mean loss; it is called with the DDP wrapper
    for training passes and with the bare module for replays. With world size 1 a
    verification re-executes the probe on the same device, which catches transient faults only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: GuardConfig | None = None,
        node: str | NodeIdentity | None = None,
    ) -> None:
        self.config = config if config is not None else GuardConfig()
        if not isinstance(self.config, GuardConfig):
            raise GuardConfigError("config must be a GuardConfig")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        ddp = model if isinstance(model, DistributedDataParallel) else None
        self._ddp = ddp is not None
        self.module: torch.nn.Module = ddp.module if ddp is not None else model  # type: ignore[assignment]
        self.comm = Comm(ddp.process_group if ddp is not None else None)
        if self.comm.world_size > 1 and not self._ddp:
            raise GuardConfigError("with world size > 1 the model must be wrapped in DistributedDataParallel")
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise GuardConfigError("the model has no trainable parameters")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]

        env: RuntimeInfo | None = None
        if node is None or self.config.job_id is None:
            env = RuntimeInfo.from_env()
        if node is None:
            assert env is not None
            identity = env.node
        elif isinstance(node, str):
            identity = NodeIdentity(name=node)
        else:
            identity = node
        self.job_id = self.config.job_id or (env.job_id if env else "local")
        self.node = identity
        self.nodes: list[NodeIdentity] = self.comm.gather_objects(identity)
        self.ring = Ring.build([n.name for n in self.nodes])
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size

        self._fingerprinter = Fingerprinter(self.config.mode, self.config.sketch_k)
        self._health = GradHealth(self.comm.group, digest_reduced=self.config.check_reduced and self.world_size > 1)
        self._hooked = False
        if ddp is not None:
            try:
                ddp.register_comm_hook(None, self._health.comm_hook)
                self._hooked = True
            except RuntimeError:
                # The user owns the comm hook: checks then run after the all-reduce only.
                self._hooked = False
        self._batchnorms = [m for m in self.module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        self._next_step = self.config.start_step
        self._needs_rebuild = self._ddp and self.config.start_step > 0 and self.config.rebuild_buckets_on_resume
        self.last_verified_step: int | None = self.config.resume_verified_step
        self._noise = 0.0
        self._calibrations = 0
        self._reporter = IncidentBuilder(self)

    # -- public -----------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """Index of the step the next call to :meth:`step` runs."""
        return self._next_step

    def add_reduced_gradient_hook(self, hook: ReducedHook) -> Callable[[], None]:
        """Call ``hook(bucket_index, tensor)`` on each reduced gradient bucket; returns a remover."""
        self._health.reduced_hooks.append(hook)
        return lambda: self._health.reduced_hooks.remove(hook) if hook in self._health.reduced_hooks else None

    def check_replicas(self) -> None:
        """Collective: compare weights and optimizer state now; raise CorruptionDetected if they differ."""
        step = self._next_step - 1
        row = torch.zeros(2, dtype=torch.int64)
        row[0], row[1] = replicas.weights_digest(self.params), replicas.optimizer_digest(self.optimizer)
        rows = self.comm.gather_rows(row)
        findings = replicas.findings(rows[:, 0].tolist(), rows[:, 1].tolist())
        if findings:
            self._raise(step, findings)

    def step(self, *microbatches: Any) -> StepResult:
        """Run one guarded optimizer step over one batch or several micro-batches."""
        if not microbatches:
            raise BatchError("step() needs at least one batch")
        cfg = self.config
        s = self._next_step
        sizes = [batch_size(mb) for mb in microbatches]
        total = sum(sizes)
        verify = s % cfg.verify_every == 0
        check_replicas = self.world_size > 1 and cfg.weights_every > 0 and s % cfg.weights_every == 0
        if self._needs_rebuild:
            self._rebuild_buckets(microbatches[0])
        self.optimizer.zero_grad(set_to_none=True)
        self._health.reset()

        mbs, weights = list(microbatches), [n / total for n in sizes]
        losses: list[tuple[float, torch.Tensor]] = []
        passes: list[replicas.Pass] = []  # what ran, for a re-run on the failure path
        own: dict[str, Any] | None = None
        if verify:
            own, consumed = self._own_probe(s, mbs[0], sizes[0], total, more=len(mbs) > 1)
            if consumed is not None:
                losses.append(consumed[0])
                passes.append((own["batch"], own["weight"], own["seed"]))
                if consumed[1] is None:
                    mbs.pop(0), weights.pop(0)
                else:
                    mbs[0] = consumed[1]
                    weights[0] = (sizes[0] - own["size"]) / total
        for i, mb in enumerate(mbs):
            sync = i == len(mbs) - 1 or not self._ddp
            ctx = contextlib.nullcontext() if sync else self.model.no_sync()  # type: ignore[operator]
            with ctx, running(s, "train"):
                loss = self.loss_fn(self.model, mb)
                (loss * weights[i]).backward()
            losses.append((weights[i], loss.detach()))
            passes.append((mb, weights[i], None))
        if not self._hooked:
            grads = [p.grad for p in self.params if p.grad is not None]
            self._health.observe_local(grads)
            self._health.observe_reduced(grads)

        row = torch.zeros(_ROW, dtype=torch.int64)
        step_loss = float(sum(w * l.double() for w, l in losses))
        row[_LOSS] = float_bits(step_loss)
        row[_LOCAL_NORM] = float_bits(self._health.local_norm())
        row[_REDUCED] = self._health.reduced_digest()
        if check_replicas:
            row[_WEIGHTS] = replicas.weights_digest(self.params)
            row[_OPT] = replicas.optimizer_digest(self.optimizer)
        view: LocalView | None = None
        if verify:
            assert own is not None
            view, distance, noise = self._verify_pair(s, own)
            row[_VERIFIED], row[_PAIR], row[_NOISE] = 1, float_bits(distance), float_bits(noise)
        rows = self.comm.gather_rows(row)

        findings = self._evaluate(s, rows, check_replicas, view, passes)
        if findings:
            self._raise(s, findings)
        with running(s, "optimizer"):
            self.optimizer.step()
        if verify:
            self.last_verified_step = s
        self._next_step = s + 1
        return StepResult(loss=step_loss, step=s, verified=verify, replicas_checked=check_replicas)

    # -- the verification pass --------------------------------------------------------------
    def _probe_mode(self) -> str:
        if self.config.probe != "auto":
            return self.config.probe
        return "extra" if any(m.training for m in self._batchnorms) else "split"

    def _own_probe(
        self, s: int, first: Any, size: int, total: int, more: bool
    ) -> tuple[dict[str, Any], tuple[tuple[float, torch.Tensor], Any] | None]:
        """Compute this rank's probe; in split mode it is also the first part of the real batch."""
        cfg = self.config
        p = min(cfg.probe_size, size)
        probe_batch, rest = split(first, p)
        seed = probe_seed(cfg.seed, s, self.rank)
        weight = p / total
        det = cfg.use_deterministic
        consumed = None
        if self._probe_mode() == "split" and (size > p or more):
            ctx = self.model.no_sync() if self._ddp else contextlib.nullcontext()  # type: ignore[operator]
            with ctx, running(s, "probe"), seeded(seed, self.params[0].device), deterministic(det):
                loss = self.loss_fn(self.model, probe_batch)
                (loss * weight).backward()
            result = ProbeResult(float(loss.detach()), self._fingerprinter([q.grad for q in self.params], seed))
            consumed = ((weight, loss.detach()), rest if size > p else None)
        else:
            result = replay(self.module, self.loss_fn, probe_batch, weight=weight, seed=seed, params=self.params,
                            fingerprinter=self._fingerprinter, deterministic_kernels=det, step=s, pass_="probe")
        payload = {"step": s, "source": self.rank, "batch": probe_batch, "weight": weight, "seed": seed,
                   "size": p, "result": result.to_wire()}
        return payload, consumed

    def _replayer(self, s: int) -> Callable[[dict[str, Any]], ProbeResult]:
        def run(payload: dict[str, Any]) -> ProbeResult:
            return replay(self.module, self.loss_fn, payload["batch"], weight=payload["weight"], seed=payload["seed"],
                          params=self.params, fingerprinter=self._fingerprinter,
                          deterministic_kernels=self.config.use_deterministic, step=s)
        return run

    def _verify_pair(self, s: int, own: dict[str, Any]) -> tuple[LocalView, float, float]:
        """Send our probe to our verifier, replay our source's probe; return the comparison."""
        verifier, source = self.ring.verifier_of(self.rank), self.ring.source_of(self.rank)
        received = self.comm.exchange([(verifier, own)], [source])[source]
        replayer = self._replayer(s)
        replayed = replayer(received)
        claim = ProbeResult.from_wire(received["result"])
        mode = self.config.mode
        distance = compare(claim, replayed, mode, math.inf).distance
        noise = 0.0
        if mode == "tolerant" and self._calibrations < self.config.calibration_verifications:
            again = replayer(own)
            noise = compare(ProbeResult.from_wire(own["result"]), again, mode, math.inf).distance
        return LocalView(own_payload=own, received=received, replayed=replayed), distance, noise

    # -- verdict ------------------------------------------------------------------------------
    def _evaluate(self, s: int, rows: torch.Tensor, check_replicas: bool, view: LocalView | None,
                  passes: Sequence[replicas.Pass]) -> list[Finding]:
        cfg = self.config
        findings: list[Finding] = []
        norms = [bits_float(int(v)) for v in rows[:, _LOCAL_NORM].tolist()]
        bad = [r for r, n in enumerate(norms)
               if not math.isfinite(n) or (cfg.grad_norm_bound is not None and n > cfg.grad_norm_bound)]
        if bad:
            findings.append(replicas.gradient_finding(self, bad, norms, passes, s))
        if self._health.digest_reduced:
            f = replicas.vote_finding("reduced_gradients", rows[:, _REDUCED].tolist())
            if f is not None:
                findings.append(f)
        if check_replicas:
            findings.extend(replicas.findings(rows[:, _WEIGHTS].tolist(), rows[:, _OPT].tolist()))
        if view is not None:
            threshold = 0.0
            if cfg.mode == "tolerant":
                if self._calibrations < cfg.calibration_verifications:
                    self._noise = max(self._noise, max(bits_float(int(v)) for v in rows[:, _NOISE].tolist()))
                    self._calibrations += 1
                threshold = tolerance(self._noise, margin=cfg.tolerance_margin, floor=cfg.tolerance_floor,
                                      ceiling=cfg.tolerance_ceiling)
            failing, pairs = [], []
            for ver in range(self.world_size):
                src = self.ring.source_of(ver)
                d = bits_float(int(rows[ver, _PAIR]))
                ok = d == 0.0 if cfg.mode == "exact" else d <= threshold
                pairs.append({"source": src, "verifier": ver, "source_node": self.nodes[src].name,
                              "verifier_node": self.nodes[ver].name, "distance": d, "agree": ok})
                if not ok:
                    failing.append((src, ver))
            if failing:
                findings.append(resolve_replay(comm=self.comm, ring=self.ring, failing=failing, view=view,
                                               replayer=self._replayer(s), mode=cfg.mode, threshold=threshold,
                                               pair_evidence=pairs))
        return findings

    def _raise(self, s: int, findings: list[Finding]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        incident = self._reporter.build(s, findings)
        self._reporter.write(incident)
        raise CorruptionDetected(incident)

    def _rebuild_buckets(self, batch: Any) -> None:
        """One synced backward, gradients discarded, so DDP settles its bucket layout."""
        self._needs_rebuild = False
        with torch.random.fork_rng(devices=[]), running(self._next_step, "rebuild"), buffers_restored(self.module):
            loss = self.loss_fn(self.model, batch)
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        self._health.reset()
