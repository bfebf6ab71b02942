"""Simulated kernel non-determinism and per-rank kernel choices, for tolerant-mode drills.

Real default kernels (atomics, split reductions) give answers that differ in the last bits from
run to run, and two nodes may pick different kernels (another cuBLAS algorithm, driver or
autotuning result) whose answers differ by a constant rounding pattern. Two noise models stand
for them:

* :class:`KernelNoise` perturbs a module's output on every call, drawn from the rank's *own*
  generator — never the torch global RNG, which the guard seeds per (step, rank) for probe
  passes and replays, so noise drawn from it would repeat exactly in a replay. Its ``shape``
  says what the perturbation looks like (dense relative, additive on the activation scale,
  sparse one-ulp flips, heavy-tailed).
* :class:`RankBias` scales a module's output by a constant on the listed ranks: no randomness,
  the same on every pass, so replays on that rank agree with each other and not with the others.

Both change the output in place (through ``.data``: autograd does not see it, as it would not
see a kernel's rounding) and leave non-floating outputs alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from replicheck.faults.errors import FaultConfigError
from replicheck.guard.modules import unwrap

NoiseShape = Literal["gaussian", "additive", "ulp", "heavy"]
"""What a :class:`KernelNoise` perturbation looks like (see :attr:`KernelNoise.shape`)."""

_SHAPES: tuple[str, ...] = get_args(NoiseShape)


def _noop() -> None:
    """The remover of a noise model not installed on this rank."""


def _check_module(module: object) -> None:
    if not isinstance(module, str) or not module:
        raise FaultConfigError(f"module must be a non-empty module name, got {module!r}")


def _check_ranks(ranks: object, *, allow_none: bool) -> tuple[int, ...] | None:
    """``ranks`` as a tuple of non-negative ints (a list is accepted and made a tuple)."""
    if ranks is None:
        if allow_none:
            return None
        raise FaultConfigError("ranks must name at least one rank")
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise FaultConfigError(f"ranks must be a tuple of ints, got {ranks!r}")
    out = tuple(ranks)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise FaultConfigError(f"ranks must be non-negative ints, got {ranks!r}")
    if not out:
        raise FaultConfigError("ranks must name at least one rank (None: every rank)")
    return out


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FaultConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _target(model: torch.nn.Module, name: str) -> torch.nn.Module:
    modules = dict(unwrap(model).named_modules())
    if name not in modules:
        raise FaultConfigError(f"no module named {name!r} in the model")
    return modules[name]


def _student_t(shape: torch.Size, gen: torch.Generator, df: float, clip: float) -> torch.Tensor:
    """Student-t draws with ``df`` degrees of freedom clipped at ``±clip`` (float64, CPU).

    Bailey's polar method with the point of the unit disc drawn as (squared radius ``w``,
    angle): ``T = cos(angle) · sqrt(df · (w^(-2/df) - 1))``. Two uniforms per value from ``gen``,
    no rejection loop, any ``df > 0`` (torch's own t and gamma samplers take no generator).
    """
    w = 1.0 - torch.rand(shape, generator=gen, dtype=torch.float64)  # (0, 1]: no division by 0
    angle = torch.rand(shape, generator=gen, dtype=torch.float64) * (2 * math.pi)
    size = (df * (w.pow(-2.0 / df) - 1.0)).sqrt()
    # A tiny w overflows the power for small df; cap first so cos(angle) × size is never inf × 0.
    size = size.nan_to_num(posinf=clip).clamp(max=clip)
    return (angle.cos() * size).clamp(-clip, clip)


@dataclass(frozen=True, kw_only=True)
class KernelNoise:
    """Noise on one module's output, every call, on every rank it is installed on."""

    module: str
    """Module name in the bare model."""
    rel: float = 1e-6
    """Size of the perturbation: the relative standard deviation (``gaussian``), or the standard
    deviation in units of the output's mean absolute value (``additive``, ``heavy``); unused by
    ``ulp``."""
    seed: int | None = None
    """Seed of the private generator (mixed with the rank); ``None``: fresh entropy."""
    shape: NoiseShape = "gaussian"
    """``gaussian``: ``out · (1 + rel · N(0,1))`` on every value; ``additive``:
    ``out + rel · mean|out| · N(0,1)`` (near-zero values move a lot relative to themselves, as a
    reordered sum's rounding does); ``ulp``: a random ``fraction`` of the values moved by one ulp
    of the output's dtype, up or down, the rest untouched (split reductions and atomics);
    ``heavy``: ``out + rel · mean|out| · T``, ``T`` Student-t with ``df`` degrees of freedom
    clipped at ``±clip`` (rare large deviations)."""
    fraction: float = 1e-3
    """``ulp``: the probability that a value is moved (0 < fraction <= 1)."""
    df: float = 2.0
    """``heavy``: degrees of freedom of the Student-t (> 0; smaller is heavier-tailed)."""
    clip: float = 100.0
    """``heavy``: ``|T|`` is at most this (> 0)."""
    ranks: tuple[int, ...] | None = None
    """Ranks it is installed on; ``None``: every rank. :meth:`install` on another rank does
    nothing and returns a remover that does nothing."""

    def __post_init__(self) -> None:
        _check_module(self.module)
        if _finite("rel", self.rel) < 0:
            raise FaultConfigError(f"rel must be >= 0, got {self.rel!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise FaultConfigError(f"seed must be an int or None, got {self.seed!r}")
        if self.shape not in _SHAPES:
            raise FaultConfigError(f"shape must be one of {', '.join(_SHAPES)}, got {self.shape!r}")
        if not 0 < _finite("fraction", self.fraction) <= 1:
            raise FaultConfigError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if _finite("df", self.df) <= 0:
            raise FaultConfigError(f"df must be > 0, got {self.df!r}")
        if _finite("clip", self.clip) <= 0:
            raise FaultConfigError(f"clip must be > 0, got {self.clip!r}")
        object.__setattr__(self, "ranks", _check_ranks(self.ranks, allow_none=True))

    def install(self, model: torch.nn.Module, rank: int = 0) -> Callable[[], None]:
        """Hook the noise in on ``rank``; returns the remover."""
        target = _target(model, self.module)
        if self.ranks is not None and rank not in self.ranks:
            return _noop
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed * 7919 + rank)
        perturb = self._perturbation(gen)

        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                perturb(out.data)

        return target.register_forward_hook(hook).remove

    def _perturbation(self, gen: torch.Generator) -> Callable[[torch.Tensor], None]:
        """The in-place change of one output tensor, drawing from ``gen`` (on the CPU; the draws
        are moved to the output's device)."""
        rel, fraction, df, clip = self.rel, self.fraction, self.df, self.clip

        def gaussian(out: torch.Tensor) -> None:
            # Drawn in the output's dtype, as before the other shapes existed: same seed, same noise.
            noise = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
            out.mul_(noise.mul_(rel).add_(1.0))

        def scaled(draw: Callable[[torch.Size], torch.Tensor]) -> Callable[[torch.Tensor], None]:
            def apply(out: torch.Tensor) -> None:
                # Half-precision outputs are perturbed in fp32 and rounded back once.
                work = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
                scale = rel * work.abs().mean()
                out.copy_(work + draw(out.shape).to(device=out.device, dtype=work.dtype) * scale)

            return apply

        def ulp(out: torch.Tensor) -> None:
            flip = torch.rand(out.shape, generator=gen) < fraction
            up = torch.rand(out.shape, generator=gen) < 0.5
            flip, up = flip.to(out.device), up.to(out.device)
            inf = torch.tensor(float("inf"), dtype=out.dtype, device=out.device)
            toward = torch.where(up, inf, -inf)
            out.copy_(torch.where(flip, torch.nextafter(out, toward), out))

        if self.shape == "gaussian":
            return gaussian
        if self.shape == "additive":
            return scaled(lambda shape: torch.randn(shape, generator=gen, dtype=torch.float32))
        if self.shape == "heavy":
            return scaled(lambda shape: _student_t(shape, gen, df, clip))
        return ulp


@dataclass(frozen=True, kw_only=True)
class RankBias:
    """A rank-specific constant bias: another kernel choice on one node (cuBLAS algorithm,
    driver, autotuning): ``out · (1 + scale)`` on every pass of the listed ranks, no randomness."""

    module: str
    """Module name in the bare model."""
    scale: float = 2e-6
    """Relative change of every output value (finite, > -1)."""
    ranks: tuple[int, ...] = (1,)
    """Ranks whose kernels differ; :meth:`install` on another rank does nothing."""

    def __post_init__(self) -> None:
        _check_module(self.module)
        if _finite("scale", self.scale) <= -1:
            raise FaultConfigError(f"scale must be > -1, got {self.scale!r}")
        object.__setattr__(self, "ranks", _check_ranks(self.ranks, allow_none=False))

    def install(self, model: torch.nn.Module, rank: int = 0) -> Callable[[], None]:
        """Hook the bias in on ``rank``; returns the remover."""
        target = _target(model, self.module)
        if rank not in self.ranks:
            return _noop
        factor = 1.0 + self.scale

        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                out.data.mul_(factor)

        return target.register_forward_hook(hook).remove


NoiseModel = KernelNoise | RankBias
"""A simulated kernel behaviour :func:`install_noise` takes."""


def install_noise(models: Sequence[NoiseModel], model: torch.nn.Module, rank: int) -> Callable[[], None]:
    """Install every noise model on ``model`` for ``rank``, in order (hooks on the same module
    chain: each sees the previous one's output); returns one remover of them all.

    When one refuses (an unknown module), those already installed are removed before the error
    propagates.
    """
    removers: list[Callable[[], None]] = []
    try:
        for m in models:
            if not isinstance(m, (KernelNoise, RankBias)):
                raise FaultConfigError(f"not a noise model: {m!r}")
            removers.append(m.install(model, rank=rank))
    except BaseException:
        for r in reversed(removers):
            r()
        raise

    def remove() -> None:
        for r in reversed(removers):
            r()

    return remove
