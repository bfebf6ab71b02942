"""The passes of one guarded step on this rank: the probe (split from the batch or extra) and the
training passes, with the loss contract (weights, ``LossSum`` division) and the failure protocol."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig, ProbeMode
from replicheck.guard.context import running
from replicheck.guard.errors import GuardError, LossContractError
from replicheck.guard.loss import Count, LossFn, check_counts, step_counts, unpack
from replicheck.guard.parallel.base import Parallelism
from replicheck.guard.step.failure import StepFailure
from replicheck.guard.step.replay import (
    BackwardPass,
    Fingerprinter,
    Recompute,
    deterministic,
    probe_seed,
    seeded,
)
from replicheck.guard.step.rng import drew_random, generator_states
from replicheck.guard.transport.batch import split
from replicheck.guard.transport.records import ProbePayload, ProbeResult
from replicheck.guard.transport.transfer import host_result, to_host


@dataclass(frozen=True)
class SplitProbe:
    """In ``split`` mode the probe is the front of the first micro-batch and counts for the step."""

    loss: torch.Tensor
    """The probe's (detached) loss."""
    count: Count | None
    """Its item count when ``loss_fn`` returned a ``LossSum`` (a tensor is read with the step's)."""
    weight: float
    """Its share of the step's loss (1 for a ``LossSum``: the step rescales at the end)."""
    rest: Any | None
    """The rest of the first micro-batch, or ``None`` when the probe took all of it."""


@dataclass(frozen=True)
class OwnProbe:
    """This rank's probe of a verification step."""

    payload: ProbePayload
    """What is sent to the verifier."""
    split: SplitProbe | None
    """Set when the probe already ran as part of the real batch."""


@dataclass
class Backward:
    """What the step's backward passes left behind."""

    loss: torch.Tensor
    """The rank's loss for the step (float64, on the device: it reaches the host in the row)."""
    passes: list[BackwardPass]
    """The passes as they ran, for a re-run on the failure path."""


class StepPasses:
    """Runs the forward and backward passes of this rank's step (not the replays)."""

    def __init__(
        self,
        *,
        config: GuardConfig,
        parallelism: Parallelism,
        loss_fn: LossFn,
        params: Sequence[torch.nn.Parameter],
        fail: StepFailure,
        recompute: Recompute,
        fingerprinter: Fingerprinter,
        health: GradStats,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self._config, self._par, self._loss_fn = config, parallelism, loss_fn
        self._model, self._rank = parallelism.model, parallelism.comm.rank
        self._params = list(params)
        self._fail, self._recompute, self._fingerprinter = fail, recompute, fingerprinter
        self._health, self._scaler = health, scaler
        self._batchnorms = [
            m for m in parallelism.module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        ]
        self._loss_sum: bool | None = None  # whether loss_fn returns a LossSum; None: not seen yet
        # Whether a training forward draws random numbers (dropout); None: not seen yet.
        self._draws_random: bool | None = None
        self._rng_devices = tuple(dict.fromkeys([parallelism.device, *(p.device for p in self._params)]))
        self._warned_split = False
        self._warned_held = False

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward runs on: scaled by the job's loss scaler, when there is one."""
        return self._scaler.scale(loss) if self._scaler is not None else loss

    def backward(self, s: int, mbs: list[Any], sizes: Sequence[int], own: OwnProbe | None) -> Backward:
        """The training passes (after a split probe, the rest of the batch); the last one syncs.

        Plain losses are weighted by ``loss_reduction`` (sample share, or 1 for a sum). ``LossSum``
        passes run unscaled and the gradient is divided by the step's item count just before
        the last (synced) backward, so the all-reduced gradient is the unsplit one.
        """
        total = sum(sizes)
        per_pass = 1.0 if self._config.loss_reduction == "sum" else None
        weights = [per_pass if per_pass is not None else n / total for n in sizes]
        parts: list[tuple[float, torch.Tensor, Count | None]] = []  # (weight, loss, count)
        passes: list[BackwardPass] = []
        if own is not None and own.split is not None:
            probe = own.split
            parts.append((probe.weight, probe.loss, probe.count))
            passes.append(BackwardPass(batch=own.payload.batch, weight=probe.weight, seed=own.payload.seed))
            if probe.rest is None:
                mbs.pop(0)
                weights.pop(0)
            else:
                mbs[0] = probe.rest
                if per_pass is None:
                    weights[0] = (sizes[0] - own.payload.size) / total
        scale = 1.0
        # A LossSum's normaliser known before the first backward (config.item_count): every
        # pass is then reduced as it ends, already divided (no unreduced accumulation).
        known = self._known_items(mbs, parts) if self._loss_sum else None
        early = known is not None and len(mbs) > 1 and self._par.reduces_every_pass
        glob = self._config.global_item_count
        if self._loss_sum and known is None and len(mbs) > 1 and self._par.reduces_every_pass:
            self._warn_held()
        if early and known is not None:
            if glob:
                known = self._global_sum(torch.tensor(known, dtype=torch.float64))[1]
            if known:
                scale = self._normaliser(known)
                self._par.set_reduction_scale(scale)
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with self._par.accumulate(sync=last), running(s, "train"):
                run = functools.partial(self._checked_loss if early else self._loss_fn, self._model, mb)
                if i == 0 and self._draws_random is None:
                    run = functools.partial(self._watched, run)
                got = self._fail.forward(run, "training pass")
                if got is None:
                    # This rank failed: no backward of its own, but its part in the synchronising
                    # one's collectives (its peers learn of the failure from the step's row).
                    if glob and last and not early:
                        self._global_sum(torch.zeros((), dtype=torch.float64))
                    self._fail.join_backward(synced=last)
                    continue
                loss, count = got
                self._note_loss_kind(count)
                w = weights[i]
                # Where each pass's gradient is reduced across ranks, a LossSum's division by this
                # rank's item count cannot wait until after earlier passes: unless it was known
                # before them, they accumulate unreduced and the last reduction divides
                # (set_reduction_scale).
                deferred = count is not None and len(mbs) > 1 and self._par.reduces_every_pass and not early
                if glob and last and not early:
                    # Every rank joins the count's all-reduce (a plain loss adds nothing and is
                    # this rank's error), so no rank waits in it.
                    counts = [c for _, _, c in parts if c is not None] + (
                        [count] if count is not None else []
                    )
                    items = self._global_items(counts)
                    if count is None:
                        self._fail.note(
                            LossContractError("GuardConfig(global_item_count=True) needs a LossSum loss")
                        )
                if count is not None and early:
                    w = 1.0
                elif count is not None:
                    w = 1.0
                    if last:
                        if not glob:
                            # Every pass's count read now, together (one transfer for tensor
                            # counts); a bad one is this rank's error, reported in the step's flags.
                            counts = [c for _, _, c in parts if c is not None] + [count]
                            read = self._fail.attempt(functools.partial(step_counts, counts))
                            items = 0.0 if read is None else sum(read[:-1]) + read[-1]
                        scale = self._normaliser(items)
                        if deferred:
                            self._par.set_reduction_scale(scale)
                        else:
                            w = scale
                            self._scale_grads(scale)
                with self._par.hold_reduction(not (last or not deferred)):
                    self._fail.backward(self._scaled(loss * w), synced=last)
            parts.append((w, loss.detach(), count))
            passes.append(BackwardPass(batch=mb, weight=w, seed=None))
        self._par.set_reduction_scale(1.0)
        if self._health.errors:
            self._fail.note(self._health.errors[0])
        # A verification step's ring exchange and replays are collectives a failed rank would
        # skip: every rank must stop before them. An ordinary step's failure rides in its row.
        self._fail.stop_after_passes(s, collectives_follow=own is not None)
        if self._fail.failed:
            # Under DDP, and FSDP2 on an ordinary step, a failed rank goes on to the step's row,
            # which stops every rank.
            return Backward(loss=torch.zeros((), dtype=torch.float64, device=self._par.device), passes=[])
        if self._loss_sum:
            passes = [dataclasses.replace(p, weight=scale) for p in passes]
            step_loss = _total(part.double() for _, part, _ in parts) * scale
        else:
            step_loss = _total(w * part.double() for w, part, _ in parts)
        self._health.after_passes(self._params)
        if self._health.errors:
            self._fail.note(self._health.errors[0])
        return Backward(loss=step_loss, passes=passes)

    def _normaliser(self, items: float) -> float:
        """What a ``LossSum`` step's gradient is multiplied by: 1 / its items, or with a global
        count world size / the items of every rank (the reduction's mean over ranks then gives
        the global mean)."""
        if not items > 0:
            return 1.0
        if self._config.global_item_count:
            return self._par.comm.world_size / items
        return 1.0 / items

    def _global_sum(self, local: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Collective: ``local`` (a float64 scalar) summed over every rank, on the communication
        device, and as a number."""
        comm = self._par.comm
        total = local.to(comm.device, torch.float64).reshape(1)
        if comm.world_size > 1:
            dist.all_reduce(total, group=comm.group)
        return total, float(to_host(total, "global item count")[0])

    def _global_items(self, counts: Sequence[Count]) -> float:
        """Collective: the step's item count over every rank. Tensor counts stay on their device
        until the sum over ranks is read: this rank's counts and the global sum reach the host
        together, in one transfer. A bad count is this rank's error (it still joins, with 0)."""
        comm = self._par.comm
        tensors = [c for c in counts if isinstance(c, torch.Tensor)]
        numbers = [float(c) for c in counts if not isinstance(c, torch.Tensor)]
        stacked = (
            torch.stack([t.to(comm.device, torch.float64).reshape(()) for t in tensors])
            if tensors
            else torch.zeros(0, dtype=torch.float64, device=comm.device)
        )
        local = (
            stacked.sum() + sum(numbers) if self._fail.error is None else torch.zeros((), dtype=torch.float64)
        )
        total = local.to(comm.device, torch.float64).reshape(1)
        if comm.world_size > 1:
            dist.all_reduce(total, group=comm.group)
        read = to_host(torch.cat([stacked, total]), "LossSum.count").tolist()
        self._fail.attempt(functools.partial(check_counts, [*read[:-1], *numbers]))
        return 0.0 if self._fail.error is not None else float(read[-1])

    def _watched(self, run: Any) -> object:
        """``run()``, noting whether it drew random numbers from the generators it may use."""
        before = generator_states(self._rng_devices)
        out = run()
        self._draws_random = bool(self._draws_random) or drew_random(
            before, generator_states(self._rng_devices)
        )
        return out

    def _known_items(
        self, mbs: Sequence[Any], parts: Sequence[tuple[float, torch.Tensor, Count | None]]
    ) -> float | None:
        """The step's item count from ``config.item_count`` before any forward, else ``None``."""
        if self._config.item_count is None:
            return None
        before = sum(step_counts([c for _, _, c in parts if c is not None]))
        return before + sum(float(self._config.item_count(mb)) for mb in mbs)

    def _warn_held(self) -> None:
        if not self._warned_held:
            self._warned_held = True
            warnings.warn(
                f"{self._par.kind} with a LossSum over several micro-batches: each rank holds its "
                "whole unsharded gradient until the last micro-batch, as the division by the step's "
                "item count is known only then; pass GuardConfig(item_count=...) (the count from "
                "a micro-batch alone) to reduce-scatter every micro-batch",
                stacklevel=4,
            )

    def _checked_loss(self, model: torch.nn.Module, mb: Any) -> object:
        """``loss_fn`` whose ``LossSum.count`` must be ``config.item_count(mb)``: raised inside the
        forward, so every rank learns of it before the backward's collectives."""
        out = self._loss_fn(model, mb)
        count = unpack(out)[1]
        expected = None if self._config.item_count is None else float(self._config.item_count(mb))
        # A device-tensor count is read here: the check must run before the backward's collectives.
        if count is not None and expected is not None and step_counts([count])[0] != expected:
            raise LossContractError(
                f"LossSum.count is {float(count)} but config.item_count says {expected} "
                "for the same micro-batch: they must count the same items"
            )
        return out

    def _note_loss_kind(self, count: Count | None) -> None:
        kind = count is not None
        if self._loss_sum is not None and kind != self._loss_sum:
            raise LossContractError("loss_fn must return a LossSum on every call or on none")
        self._loss_sum = kind

    def _scale_grads(self, scale: float) -> None:
        """Scale what earlier (unsynced) passes accumulated, before the synced pass adds to it."""
        if scale == 1.0:
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, scale)  # one launch for the model, not one per parameter

    def probe_mode(self) -> ProbeMode:
        """``split`` only where it leaves the update unchanged; else ``extra``."""
        cfg = self._config
        if not self._par.split_probe:
            return "extra"
        if cfg.probe == "extra" or (
            cfg.probe == "auto" and (self._draws_random or any(m.training for m in self._batchnorms))
        ):
            # A split probe runs seeded: with dropout its samples would not get the masks the
            # plain loop draws, and the rest of the batch would draw from a shifted stream.
            return "extra"
        if self._loss_sum or cfg.loss_reduction != "unknown":
            return "split"
        if cfg.probe == "split" and self._loss_sum is False and not self._warned_split:
            self._warned_split = True
            warnings.warn(
                "probe='split' needs a loss whose split is exact: return a LossSum from loss_fn or "
                "set GuardConfig.loss_reduction; using probe='extra' so the update is unchanged",
                stacklevel=3,
            )
        return "extra"

    def own_probe(self, s: int, first: Any, size: int, total: int, more: bool) -> OwnProbe:
        """Compute this rank's probe; in split mode it is also the first part of the real batch."""
        cfg = self._config
        p = min(cfg.probe_size, size)
        probe_batch, rest = split(first, p)
        seed = probe_seed(cfg.seed, s, self._rank)
        weight = 1.0 if self._loss_sum or cfg.loss_reduction == "sum" else p / total
        # Replays multiply by the loss scale as a number (a power of two: exact), read once here.
        loss_scale = self._scaler.get_scale() if self._scaler is not None else 1.0
        split_probe = None
        auto = cfg.probe == "auto"
        if self.probe_mode() == "split" and (size > p or more):
            with (
                self._par.accumulate(sync=False),
                running(s, "probe"),
                seeded(seed, self._par.device),
                deterministic(cfg.use_deterministic, cfg.probe_attention),
            ):
                run = functools.partial(self._loss_fn, self._model, probe_batch)
                got = self._fail.forward(functools.partial(self._watched, run) if auto else run, "probe")
                abandoned = got is not None and auto and bool(self._draws_random)
                if abandoned:
                    # The forward drew random numbers (dropout): a split would change the update.
                    # Its graph is dropped unused; the probe runs as an extra pass instead.
                    got = None
                elif got is not None:
                    loss, count = got
                    self._note_loss_kind(count)
                    weight = 1.0 if count is not None else weight
                    self._fail.backward(loss * (weight * loss_scale), synced=False)
            if got is None and not abandoned:
                # This rank failed: keep the step's shape (the same passes, so the same flags
                # as its peers) until every rank stops after the passes.
                result = ProbeResult(math.nan, torch.zeros(0))
                loss, count = torch.zeros(()), None
            elif got is not None:
                result = host_result(loss, self._fingerprinter([q.grad for q in self._params], seed))
            if not abandoned:
                split_probe = SplitProbe(
                    loss=loss.detach(), count=count, weight=weight, rest=rest if size > p else None
                )
        if split_probe is None:
            # An error here stops every rank at the first training pass's forward.
            computed = self._fail.attempt(
                lambda: self._recompute.probe(
                    probe_batch, weight=weight * loss_scale, seed=seed, step=s, pass_="probe"
                )
            )
            result = computed if computed is not None else ProbeResult(math.nan, torch.zeros(0))
        payload = ProbePayload(
            step=s,
            source=self._rank,
            batch=probe_batch,
            weight=weight * loss_scale,
            seed=seed,
            size=p,
            result=result,
        )
        return OwnProbe(payload=payload, split=split_probe)


def _total(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parts added in order on their device (as the float sum was, so the bits are the same)."""
    out: torch.Tensor | None = None
    for p in parts:
        out = p if out is None else out + p
    if out is None:
        raise GuardError("internal: a step without passes")
    return out
