"""Probe passes, replays and the comparison of their fingerprints."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from replicheck import fingerprint as fp
from replicheck.guard.batch import to_device
from replicheck.guard.config import Mode
from replicheck.guard.context import PassName, running
from replicheck.guard.determinism import deterministic
from replicheck.guard.health import sq_norm
from replicheck.guard.loss import LossFn, unpack
from replicheck.guard.rng import forked_rng
from replicheck.guard.transfer import host_result, to_host
from replicheck.guard.wire import ProbePayload, ProbeResult, float_bits

if TYPE_CHECKING:
    from replicheck.guard.lockstep import Lockstep

T = TypeVar("T")

Capture = Callable[[torch.Tensor, int], torch.Tensor]
"""``capture(gradient_buffer, index)``: what a sharded probe pass keeps of one layer group's
gradient (a fingerprint part, or a squared norm), on the device."""

__all__ = [
    "Capture",
    "BackwardPass",
    "Comparison",
    "Fingerprinter",
    "Recompute",
    "agrees",
    "buffers_restored",
    "compare",
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
    sketch_block: int = fp.SKETCH_BLOCK
    """Tolerant mode: values per block."""

    def __call__(self, grads: Sequence[torch.Tensor | None], seed: int) -> torch.Tensor:
        if self.mode == "exact":
            return fp.digests(grads, fold_zero=True)
        return fp.sketches(grads, seed=seed, k=self.sketch_k, block=self.sketch_block)

    def part(self, seed: int) -> Capture:
        """The fingerprint of one gradient buffer, on its device: what a sharded probe pass keeps
        of each layer group's gradient as it is produced (the same as ``self([..., t], seed)``
        gives the tensor at that index)."""
        if self.mode == "exact":
            return lambda t, i: fp.digests([t], fold_zero=True)
        return lambda t, i: fp.sketch_rows(t, index=i, seed=seed, k=self.sketch_k, block=self.sketch_block)

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fingerprint made of :meth:`part` results, in the order they were taken."""
        if parts:
            return torch.cat(list(parts))
        return self([], 0)


@dataclass(frozen=True)
class BackwardPass:
    """One backward pass of a step as it ran, so the failure path can repeat it."""

    batch: Any
    """The samples of the pass."""
    weight: float
    """Its share of the step's loss."""
    seed: int | None
    """The probe seed it ran under, or ``None`` for a training pass (unseeded)."""


class Recompute:
    """Re-runs on the bare module that touch no ``.grad``, no buffer and not the main RNG.

    Holds what every re-run needs (module, loss function, parameters, fingerprint mode,
    deterministic kernels), so the failure-path helpers get callables, not the guard.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: LossFn,
        params: Sequence[torch.nn.Parameter],
        fingerprinter: Fingerprinter,
        deterministic_kernels: bool,
    ) -> None:
        self._module = module
        self._loss_fn = loss_fn
        self._params = list(params)
        self._fingerprinter = fingerprinter
        self._deterministic = deterministic_kernels
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._scratch_backward = False
        self.lockstep: Lockstep | None = None
        """Set for a sharded model: every pass is then run by every rank at once."""

    def probe(
        self, batch: Any, *, weight: float, seed: int, step: int, pass_: PassName = "replay"
    ) -> ProbeResult:
        """Loss and fingerprint of ``batch`` run as a probe under ``seed``."""
        if self.lockstep is not None:
            return self._sharded_probe(batch, weight=weight, seed=seed, step=step, pass_=pass_)
        for _attempt in range(2):
            try:
                with (
                    running(step, pass_, discarded=True),
                    seeded(seed, self._device),
                    deterministic(self._deterministic),
                    buffers_restored(self._module),
                ):
                    loss, grads = self._gradients(batch, weight)
                break
            except _RetryWithBackward:
                continue
        return host_result(loss, self._fingerprinter(grads, seed))

    def _sharded_probe(
        self, batch: Any, *, weight: float, seed: int, step: int, pass_: PassName
    ) -> ProbeResult:
        lockstep = self.lockstep
        if lockstep is None:
            raise RuntimeError("internal: a sharded probe without lockstep")
        with (
            running(step, pass_, discarded=True),
            seeded(seed, self._device),
            deterministic(self._deterministic),
            buffers_restored(self._module),
        ):
            loss, parts = lockstep.gradients(
                lambda: self._loss_fn(self._module, to_device(batch, self._device)),
                weight,
                self._fingerprinter.part(seed),
                step,
            )
        return host_result(loss, self._fingerprinter.join(parts))

    def together(self, passes: int, run: Callable[[], T], step: int) -> T:
        """``run()``, which runs ``passes`` re-runs on this rank; on a sharded model every rank
        then runs discarded passes up to the most any rank ran (a pass is a collective there)."""
        if self.lockstep is None:
            return run()
        return self.lockstep.together(
            passes, run, lambda batch: self.probe(batch, weight=1.0, seed=0, step=step)
        )

    def _gradients(self, batch: Any, weight: float) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The pass's loss and its gradients, leaving every ``.grad`` as it was.

        ``torch.autograd.grad`` by default; reentrant activation checkpointing refuses it (it runs
        its own inner ``backward`` into ``.grad``), so from the first such refusal on the pass
        runs ``backward`` into scratch ``.grad`` slots instead.
        """
        # A batch received from another rank arrives on the host: run it where the module lives.
        loss, _ = unpack(self._loss_fn(self._module, to_device(batch, self._device)))
        scaled = loss * weight
        if self._scratch_backward:
            return loss, _backward_into_scratch(scaled, self._params)
        try:
            return loss, list(torch.autograd.grad(scaled, self._params, allow_unused=True))
        except RuntimeError as exc:
            if "use_reentrant" not in str(exc):
                raise
            self._scratch_backward = True
            raise _RetryWithBackward from exc

    def payload(self, payload: ProbePayload, step: int) -> ProbeResult:
        """Replay a probe as its source sent it."""
        return self.probe(payload.batch, weight=payload.weight, seed=payload.seed, step=step)

    def gradient_norm(self, passes: Sequence[BackwardPass], step: int) -> float:
        """The step's local gradient norm again, repeating its passes as they ran.

        Probe passes run seeded (and deterministic when the job asks for it), training passes
        unseeded, as in the step, so a fault that depends on the shape of a pass reproduces.
        """
        if self.lockstep is not None:
            return self._sharded_gradient_norm(passes, step)
        acc: list[torch.Tensor | None] = [None] * len(self._params)
        with forked_rng(p.device for p in self._params), running(step, "replay"):
            for p in passes:
                for _attempt in range(2):
                    ctx = seeded(p.seed, self._device) if p.seed is not None else contextlib.nullcontext()
                    try:
                        with ctx, deterministic(p.seed is not None and self._deterministic):
                            grads = self._gradients(p.batch, p.weight)[1]
                        break
                    except _RetryWithBackward:
                        continue
                acc = [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
        present = [g.float() for g in acc if g is not None]
        if not present:
            return 0.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
        return float(to_host(norm, "gradient re-run norm"))

    def _sharded_gradient_norm(self, passes: Sequence[BackwardPass], step: int) -> float:
        """The local norm summed over each pass's layer-group buffers, as a sharded step's row has it."""
        lockstep = self.lockstep
        if lockstep is None:
            raise RuntimeError("internal: a sharded re-run without lockstep")
        squares: list[torch.Tensor] = []
        with forked_rng(p.device for p in self._params), running(step, "replay"):
            for p in passes:
                ctx = seeded(p.seed, self._device) if p.seed is not None else contextlib.nullcontext()
                with ctx, deterministic(p.seed is not None and self._deterministic):
                    squares += lockstep.gradients(
                        functools.partial(self._loss_fn, self._module, to_device(p.batch, self._device)),
                        p.weight,
                        _square,
                        step,
                    )[1]
        if not squares:
            return 0.0
        return float(to_host(torch.stack(squares).sum().sqrt(), "gradient re-run norm"))


def _square(t: torch.Tensor, index: int) -> torch.Tensor:
    return sq_norm(t)


class _RetryWithBackward(Exception):
    """Internal: the pass must run again with ``backward`` into scratch gradients."""


def _backward_into_scratch(
    loss: torch.Tensor, params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor | None]:
    """Gradients of ``loss`` by ``backward``, with every ``.grad`` put back as it was afterwards."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.backward()  # type: ignore[no-untyped-call]
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


@dataclass(frozen=True)
class Comparison:
    """How two fingerprints of the same probe relate."""

    distance: float
    """0 when equal; exact mode: 1 when any bit differs; tolerant: max norm-scaled difference."""
    loss_equal: bool
    """Losses agree (bit for bit in exact mode, within the threshold in tolerant mode)."""
    differing: tuple[int, ...]
    """Indices of parameters whose fingerprints differ (exact) or exceed the threshold."""


def compare(a: ProbeResult, b: ProbeResult, mode: Mode, threshold: float) -> Comparison:
    """Compare two results; in tolerant mode ``threshold`` decides ``differing``."""
    if mode == "exact":
        diff = (a.fingerprint != b.fingerprint).nonzero().flatten().tolist()
        loss_equal = float_bits(a.loss) == float_bits(b.loss)
        return Comparison(
            distance=0.0 if not diff and loss_equal else 1.0, loss_equal=loss_equal, differing=tuple(diff)
        )
    per_tensor = fp.sketch_distance(a.fingerprint, b.fingerprint)
    loss_scale = max(abs(a.loss), abs(b.loss), 1e-30)
    loss_dist = abs(a.loss - b.loss) / loss_scale if a.loss == a.loss and b.loss == b.loss else float("inf")
    if a.loss == b.loss:
        loss_dist = 0.0
    worst = max(float(per_tensor.max()) if per_tensor.numel() else 0.0, loss_dist)
    diff = (per_tensor > threshold).nonzero().flatten().tolist()
    return Comparison(distance=worst, loss_equal=loss_dist <= threshold, differing=tuple(diff))


def agrees(c: Comparison, mode: Mode, threshold: float) -> bool:
    return c.distance == 0.0 if mode == "exact" else c.distance <= threshold
