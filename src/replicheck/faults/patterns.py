"""What a fault does to a tensor: the corruption patterns.

Every pattern changes a tensor *in place* through a detached view (autograd does not see the
change, as it would not see a hardware fault) and returns what it changed: the flat positions
and the values before and after. Randomness (positions, bits) comes only from the generator
the caller passes, so a seeded injector is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from replicheck.faults.errors import FaultConfigError

# Bit layout of the floating-point formats a pattern may target: (mantissa bits, exponent bits).
_LAYOUT: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (23, 8),
    torch.float16: (10, 5),
    torch.bfloat16: (7, 8),
    torch.float64: (52, 11),
}
_INT_VIEW: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}

BitField = Literal["mantissa", "exponent", "any"]


@dataclass(frozen=True)
class Change:
    """What one application of a pattern changed."""

    kind: str
    """Name of the pattern that acted (for a mix: the pattern it drew)."""
    positions: tuple[int, ...]
    """Flat indices into the tensor."""
    old: tuple[float, ...]
    """Values before, one per position."""
    new: tuple[float, ...]
    """Values after, one per position."""
    bit: int | None = None
    """The bit flipped, for bit flips."""


@runtime_checkable
class Pattern(Protocol):
    """Corrupts a tensor in place and says what it changed."""

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change: ...

    def describe(self) -> str: ...


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise FaultConfigError(f"faults corrupt floating-point tensors, got {tensor.dtype}")
    if tensor.numel() == 0:
        raise FaultConfigError("cannot corrupt an empty tensor")
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else None
    if flat is None:
        raise FaultConfigError("faults corrupt contiguous tensors only")
    return flat


def _pick(n: int, gen: torch.Generator, index: int | None) -> int:
    if index is not None:
        return index % n
    return int(torch.randint(0, n, (1,), generator=gen))


def _values(flat: torch.Tensor, pos: list[int]) -> tuple[float, ...]:
    return tuple(float(flat[p]) for p in pos)


def _span(flat: torch.Tensor, start: int, n: int) -> tuple[list[int], tuple[float, ...]]:
    """Up to ``n`` consecutive positions from ``start`` (clipped at the end) and their values."""
    pos = list(range(start, min(start + n, flat.numel())))
    return pos, _values(flat, pos)


def bit_range(dtype: torch.dtype, which: BitField) -> tuple[int, int]:
    """Inclusive range of bit indices (0 = least significant) of a field of ``dtype``."""
    if dtype not in _LAYOUT:
        raise FaultConfigError(f"no bit layout known for {dtype}")
    mant, exp = _LAYOUT[dtype]
    if which == "mantissa":
        return 0, mant - 1
    if which == "exponent":
        return mant, mant + exp - 1
    if which == "any":
        return 0, mant + exp  # includes the sign bit
    raise FaultConfigError(f"bit field must be mantissa, exponent or any, got {which!r}")


def flip_bit(flat: torch.Tensor, pos: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``pos`` of a flat floating tensor, in place."""
    size = flat.element_size()
    if not 0 <= bit < size * 8:
        raise FaultConfigError(f"bit {bit} out of range for {flat.dtype}")
    ints = flat.view(_INT_VIEW[size])
    mask = 1 << bit
    if bit == size * 8 - 1:  # the sign bit: as a signed integer the mask is negative
        mask -= 1 << (size * 8)
    ints[pos] ^= mask


@dataclass(frozen=True, kw_only=True)
class BitFlip:
    """Flip one bit of one value: a fixed ``bit``, or a random bit of ``field``."""

    bit: int | None = None
    """Bit to flip (0 = least significant); ``None``: draw one from ``field``."""
    field: BitField = "mantissa"
    """Where a random bit is drawn from when ``bit`` is ``None``."""
    index: int | None = None
    """Flat position to hit (modulo the size); ``None``: a random position each time."""

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change:
        flat = _flat(tensor)
        pos = _pick(flat.numel(), gen, self.index)
        bit = self.bit
        if bit is None:
            lo, hi = bit_range(flat.dtype, self.field)
            bit = lo + int(torch.randint(0, hi - lo + 1, (1,), generator=gen))
        old = _values(flat, [pos])
        flip_bit(flat, pos, bit)
        return Change(kind="bitflip", positions=(pos,), old=old, new=_values(flat, [pos]), bit=bit)

    def describe(self) -> str:
        return f"flip bit {self.bit}" if self.bit is not None else f"flip a random {self.field} bit"


@dataclass(frozen=True, kw_only=True)
class ZeroChunk:
    """Zero an aligned chunk of ``width`` consecutive values (a dead lane group / cache line)."""

    width: int = 32
    """Values per chunk."""
    index: int | None = None
    """Flat position inside the chunk to hit; ``None``: a random chunk each time."""

    def __post_init__(self) -> None:
        if self.width < 1:
            raise FaultConfigError(f"width must be >= 1, got {self.width}")

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change:
        flat = _flat(tensor)
        start = (_pick(flat.numel(), gen, self.index) // self.width) * self.width
        pos, old = _span(flat, start, self.width)
        flat[start : start + len(pos)] = 0
        return Change(kind="zero_chunk", positions=tuple(pos), old=old, new=_values(flat, pos))

    def describe(self) -> str:
        return f"zero a {self.width}-value chunk"


@dataclass(frozen=True, kw_only=True)
class Scale:
    """Multiply ``count`` consecutive values by ``factor``."""

    factor: float = 2.0
    """Multiplier."""
    count: int = 1
    """Consecutive values scaled."""
    index: int | None = None
    """First flat position; ``None``: random each time."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise FaultConfigError(f"count must be >= 1, got {self.count}")

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change:
        flat = _flat(tensor)
        start = _pick(flat.numel(), gen, self.index)
        pos, old = _span(flat, start, self.count)
        flat[start : start + len(pos)] *= self.factor
        return Change(kind="scale", positions=tuple(pos), old=old, new=_values(flat, pos))

    def describe(self) -> str:
        return f"scale {self.count} value(s) by {self.factor:g}"


@dataclass(frozen=True, kw_only=True)
class NonFinite:
    """Replace one value with NaN or ±Inf."""

    value: Literal["nan", "inf", "-inf"] = "nan"
    """What the value becomes."""
    index: int | None = None
    """Flat position; ``None``: random each time."""

    def __post_init__(self) -> None:
        if self.value not in ("nan", "inf", "-inf"):
            raise FaultConfigError(f"value must be nan, inf or -inf, got {self.value!r}")

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change:
        flat = _flat(tensor)
        pos = _pick(flat.numel(), gen, self.index)
        old = _values(flat, [pos])
        flat[pos] = float(self.value)
        return Change(kind=self.value, positions=(pos,), old=old, new=_values(flat, [pos]))

    def describe(self) -> str:
        return f"set a value to {self.value}"


def _default_mix() -> tuple[tuple[float, Pattern], ...]:
    # Fleet studies of GPU silent corruption report mostly zeroed values/blocks and bit flips,
    # with NaN/Inf only ~1% of outcomes (Meta's and Google's SDC-at-scale reports).
    return (
        (0.49, ZeroChunk()),
        (0.35, BitFlip(field="mantissa")),
        (0.15, BitFlip(field="exponent")),
        (0.005, NonFinite(value="nan")),
        (0.005, NonFinite(value="inf")),
    )


@dataclass(frozen=True, kw_only=True)
class SdcMix:
    """Draw one pattern per corruption from weighted choices (default: published GPU SDC mix)."""

    choices: tuple[tuple[float, Pattern], ...] = field(default_factory=_default_mix)
    """``(weight, pattern)`` pairs; weights need not sum to 1."""

    def __post_init__(self) -> None:
        if not self.choices or any(w < 0 for w, _ in self.choices) or sum(w for w, _ in self.choices) <= 0:
            raise FaultConfigError("choices need non-negative weights with a positive sum")

    def apply(self, tensor: torch.Tensor, gen: torch.Generator) -> Change:
        weights = torch.tensor([w for w, _ in self.choices], dtype=torch.float64)
        i = int(torch.multinomial(weights, 1, generator=gen))
        return self.choices[i][1].apply(tensor, gen)

    def describe(self) -> str:
        total = sum(w for w, _ in self.choices)
        parts = ", ".join(f"{100 * w / total:.1f}% {p.describe()}" for w, p in self.choices)
        return f"SDC mix ({parts})"
