"""Discarded passes on the bare module: probes, replays and re-runs, and their fingerprints.

Every pass here touches no ``.grad``, no buffer and not the main RNG stream; how it runs (alone
on this rank, or in lockstep with every rank) is the parallelism's
(:class:`~replicheck.guard.parallel.base.Replays`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from replicheck import fingerprint as fp
from replicheck.guard.config import Mode, ProbeAttention
from replicheck.guard.context import PassName, running
from replicheck.guard.loss import LossFn
from replicheck.guard.parallel.base import Capture, DiscardedPass, Parallelism
from replicheck.guard.step.determinism import deterministic
from replicheck.guard.step.rng import forked_rng
from replicheck.guard.transport.batch import to_device
from replicheck.guard.transport.records import BackwardPass, ProbePayload, ProbeResult
from replicheck.guard.transport.transfer import host_result, to_host

T = TypeVar("T")

__all__ = [
    "BackwardPass",
    "Fingerprinter",
    "Recompute",
    "buffers_restored",
    "deterministic",
    "probe_seed",
    "seeded",
]


def probe_seed(base: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s probe at ``step`` (any rank replaying it uses the same)."""
    return ((base * 1_000_003 + step) * 65_537 + rank) & 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Fork the CPU's and ``device``'s generators (the main streams are untouched); seed the forks."""
    with forked_rng([device]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put every buffer back as it was (BatchNorm statistics, counters) after a replay."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


@dataclass(frozen=True)
class Fingerprinter:
    """Turns gradients into a fingerprint in the job's mode."""

    mode: Mode
    """Fingerprint kind: exact digests or tolerant sketches."""
    sketch_k: int
    """Tolerant mode: projections per block."""
    sketch_block: int | Callable[[], int] = fp.SKETCH_BLOCK
    """Tolerant mode: values per block, or what gives it when it is first needed (the block is
    chosen by the job's precision, learnt from its first forward)."""

    @property
    def block(self) -> int:
        """Tolerant mode: values per block."""
        return self.sketch_block if isinstance(self.sketch_block, int) else self.sketch_block()

    def __call__(self, grads: Sequence[torch.Tensor | None], seed: int) -> torch.Tensor:
        if self.mode == "exact":
            return fp.digests(grads, fold_zero=True)
        return fp.sketches(grads, seed=seed, k=self.sketch_k, block=self.block)

    def part(self, seed: int) -> Capture:
        """The fingerprint of one gradient buffer, on its device: what a lockstep probe pass keeps
        of each gradient buffer as it is produced (the same as ``self([..., t], seed)`` gives the
        tensor at that index)."""
        if self.mode == "exact":
            return lambda t, i: fp.digests([t], fold_zero=True)
        # The block is read as each gradient arrives: a probe's first forward may be what
        # decides it (the job's precision).
        return lambda t, i: fp.sketch_rows(t, index=i, seed=seed, k=self.sketch_k, block=self.block)

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fingerprint made of :meth:`part` results, in the order they were taken."""
        if parts:
            return torch.cat(list(parts))
        return self([], 0)


class Recompute:
    """Re-runs on the bare module that touch no ``.grad``, no buffer and not the main RNG.

    Holds what every re-run needs (module, loss function, fingerprint mode, deterministic kernels
    and the parallelism's way of running a pass), so the failure-path helpers get callables, not
    the guard.
    """

    def __init__(
        self,
        parallelism: Parallelism,
        loss_fn: LossFn,
        params: Sequence[torch.nn.Parameter],
        fingerprinter: Fingerprinter,
        deterministic_kernels: bool,
        attention: ProbeAttention = "math",
    ) -> None:
        self._module = parallelism.module
        self._loss_fn = loss_fn
        self._device = parallelism.device
        """The compute device: passes run there (under CPU offload not where parameters are stored)."""
        self._devices = tuple(dict.fromkeys([self._device, *(p.device for p in params)]))
        self._fingerprinter = fingerprinter
        self._deterministic = deterministic_kernels
        self._attention: ProbeAttention = attention
        """Attention backends of deterministic passes (``GuardConfig.probe_attention``)."""
        self._replays = parallelism.replays(params)

    def begin_step(self, batch: Any, probe_size: int) -> None:
        """A step starts with ``batch`` as its first micro-batch."""
        self._replays.begin_step(batch, probe_size)

    def _run(self, batch: Any) -> Callable[[], object]:
        # A batch received from another rank is decoded on the host: run it on the compute device.
        return functools.partial(self._loss_fn, self._module, to_device(batch, self._device))

    def probe(
        self, batch: Any, *, weight: float, seed: int, step: int, pass_: PassName = "replay"
    ) -> ProbeResult:
        """Loss and fingerprint of ``batch`` run as a probe under ``seed``."""

        @contextlib.contextmanager
        def contexts() -> Iterator[None]:
            with (
                running(step, pass_, discarded=True),
                seeded(seed, self._device),
                deterministic(self._deterministic, self._attention),
                buffers_restored(self._module),
            ):
                yield

        p = DiscardedPass(run=self._run(batch), weight=weight, contexts=contexts)
        loss, fingerprint = self._replays.fingerprint(p, self._fingerprinter, seed)
        return host_result(loss, fingerprint)

    def together(self, passes: int, run: Callable[[], T], step: int) -> T:
        """``run()``, which runs ``passes`` re-runs on this rank; where a pass is a collective,
        every rank then runs discarded passes up to the most any rank ran."""
        return self._replays.together(
            passes, run, lambda batch: self.probe(batch, weight=1.0, seed=0, step=step)
        )

    def settle(self, step: int) -> None:
        """After the step's checks: discarded passes for the phases other ranks that run in
        lockstep with this one are still in (:meth:`Replays.settle`)."""
        self._replays.settle(lambda batch: self.probe(batch, weight=1.0, seed=0, step=step))

    def payload(self, payload: ProbePayload, step: int) -> ProbeResult:
        """Replay a probe as its source sent it."""
        return self.probe(payload.batch, weight=payload.weight, seed=payload.seed, step=step)

    def gradient_norm(self, passes: Sequence[BackwardPass], step: int) -> float:
        """The step's local gradient norm again, repeating its passes as they ran.

        Probe passes run seeded (and deterministic when the job asks for it), training passes
        unseeded, as in the step, so a fault that depends on the shape of a pass reproduces.
        """
        runs = [
            DiscardedPass(run=self._run(p.batch), weight=p.weight, contexts=self._pass_contexts(p))
            for p in passes
        ]
        with forked_rng(self._devices), running(step, "replay"):
            norm = self._replays.gradient_norm(runs)
        return 0.0 if norm is None else float(to_host(norm, "gradient re-run norm"))

    def _pass_contexts(self, p: BackwardPass) -> Callable[[], AbstractContextManager[None]]:
        @contextlib.contextmanager
        def contexts() -> Iterator[None]:
            ctx = seeded(p.seed, self._device) if p.seed is not None else contextlib.nullcontext()
            with ctx, deterministic(p.seed is not None and self._deterministic, self._attention):
                yield

        return contexts
