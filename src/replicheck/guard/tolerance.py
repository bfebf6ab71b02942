"""Tolerant mode's tolerances by precision: what the job computes in decides the sketch block, the
floor and the ceiling, from the measured noise tables (``docs/results/noise-tables.md``).

Kernel noise is mostly exact zeros and rare rounding flips that propagate, so the few calibration
verifications of a run cannot estimate its tail: the floor carries the tail (a safety factor over
the largest noise measured in thousands of replay pairs of that precision), and calibration only
raises the threshold for a job noisier than the table. A value the user sets wins, with a warning
when the measured noise can exceed it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

Precision = Literal["fp32", "fp16", "bf16"]
"""What a job's gradients are computed in: fp32, or fp16 / bf16 (autocast or half parameters)."""

PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
"""Every precision, by rank code (1, 2, 3; 0 in a row: not known yet)."""


@dataclass(frozen=True, kw_only=True)
class NoiseTable:
    """Tolerant mode's defaults for one precision and the measurement they come from."""

    precision: Precision
    """The precision the row is for."""
    sketch_block: int
    """Values per sketch block."""
    floor: float
    """Lowest threshold: the smallest change of a block (relative to its norm) that can alarm."""
    ceiling: float
    """Highest threshold calibration may reach."""
    measured_noise: float
    """Largest replay-to-replay distance measured at this block (any noise shape, same device and
    cross-rank), in ``pairs`` pairs."""
    pairs: int
    """Replay pairs behind ``measured_noise``."""


TABLES: dict[Precision, NoiseTable] = {
    # 4.5x the largest fp32 noise measured (the cross-rank pairs); the ceiling leaves calibration
    # room for GPU noise the CPU tables cannot show (TF32, atomics).
    "fp32": NoiseTable(
        precision="fp32", sketch_block=4096, floor=1e-4, ceiling=1e-2, measured_noise=2.2e-5, pairs=2000
    ),
    # 4x the largest fp16-autocast noise measured (additive and cross-rank).
    "fp16": NoiseTable(
        precision="fp16", sketch_block=256, floor=0.02, ceiling=0.1, measured_noise=4.93e-3, pairs=1997
    ),
    # 2.5x the largest bf16 noise measured (ulp flips with bf16 parameters; 2.84e-2 under autocast),
    # and 0 false alarms in the bf16 soaks (docs/results/soak-bf16.md).
    "bf16": NoiseTable(
        precision="bf16", sketch_block=256, floor=0.08, ceiling=0.2, measured_noise=3.14e-2, pairs=2000
    ),
}
"""The defaults per precision (``docs/results/noise-tables.md``)."""


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """The tolerances a tolerant-mode job runs with."""

    precision: Precision
    """What the job computes in."""
    sketch_block: int
    """Values per sketch block."""
    floor: float
    """Lowest threshold."""
    ceiling: float
    """Highest threshold."""
    chosen: tuple[str, ...]
    """The fields taken from the table (the others the user set)."""
    table: NoiseTable
    """The measured row for ``precision``."""

    def describe(self) -> str:
        """One log line: what was chosen, from what, and the smallest change that can be caught."""
        names = {"sketch_block": "block", "floor": "floor", "ceiling": "ceiling"}
        chosen = [names[n] for n in self.chosen]
        given = [names[n] for n in names if n not in self.chosen]
        how = f"{', '.join(chosen) or 'nothing'} chosen for {self.precision}"
        if given:
            how += f", {', '.join(given)} set"
        return (
            f"tolerant mode ({self.precision}): sketch block {self.sketch_block}, floor {self.floor:g}, "
            f"ceiling {self.ceiling:g} ({how}; {self.precision} noise measured up to "
            f"{self.table.measured_noise:.3g} of a {self.table.sketch_block}-value block's norm in "
            f"{self.table.pairs:,} replay pairs, docs/results/noise-tables.md). "
            f"Smallest change it can catch: {self.smallest_change()}"
        )

    def smallest_change(self) -> str:
        """The floor in words: what a fault must change to be seen."""
        factor = 1 + self.floor * (self.sketch_block / 8) ** 0.5
        return (
            f"{self.floor:.3g} of a {self.sketch_block}-value block's norm in one gradient, or of the "
            f"loss (about x{factor:.3g} on 8 values typical of their block); smaller faults need "
            f"exact mode"
        )

    def to_evidence(self) -> dict[str, float | int | str]:
        """What an incident records of the tolerances."""
        return {
            "precision": self.precision,
            "sketch_block": self.sketch_block,
            "floor": self.floor,
            "ceiling": self.ceiling,
            "measured_noise": self.table.measured_noise,
            "smallest_change": self.smallest_change(),
        }


def choose(
    precision: Precision, *, sketch_block: int | None, floor: float | None, ceiling: float | None
) -> tuple[Tolerance, list[str]]:
    """The tolerances for ``precision``: the table's, except what the user set; with a warning for
    each set value that the measured noise can exceed."""
    table = TABLES[precision]
    chosen = tuple(
        name
        for name, value in (("sketch_block", sketch_block), ("floor", floor), ("ceiling", ceiling))
        if value is None
    )
    tol = Tolerance(
        precision=precision,
        sketch_block=table.sketch_block if sketch_block is None else sketch_block,
        floor=table.floor if floor is None else floor,
        ceiling=table.ceiling if ceiling is None else ceiling,
        chosen=chosen,
        table=table,
    )
    warnings: list[str] = []
    if tol.floor > tol.ceiling:
        # Only one of the two was set: the table's other value is moved to meet it.
        moved = "floor" if floor is None else "ceiling"
        warnings.append(
            f"the {precision} table's {moved} {getattr(tol, moved):g} is moved to the set "
            f"{'ceiling' if floor is None else 'floor'} {tol.ceiling if floor is None else tol.floor:g}"
        )
        tol = replace(tol, floor=tol.ceiling) if floor is None else replace(tol, ceiling=tol.floor)
    noise = table.measured_noise
    if ceiling is not None and tol.ceiling < noise:
        warnings.append(
            f"tolerance_ceiling {tol.ceiling:g} is below the largest {precision} noise measured "
            f"({noise:.3g} per {table.sketch_block}-value block in {table.pairs:,} replay pairs): clean "
            f"training can exceed it and raise a false alarm"
        )
    if floor is not None and tol.floor < noise:
        warnings.append(
            f"tolerance_floor {tol.floor:g} is below the largest {precision} noise measured "
            f"({noise:.3g} per {table.sketch_block}-value block in {table.pairs:,} replay pairs): "
            f"unless calibration measures that much, clean training can raise a false alarm"
        )
    if sketch_block is not None and sketch_block < table.sketch_block and floor is None:
        warnings.append(
            f"sketch_block {sketch_block} is smaller than the {table.sketch_block} the {precision} floor "
            f"{tol.floor:g} was measured for: smaller blocks are noisier; set tolerance_floor too"
        )
    return tol, warnings


def code(precision: Precision | None) -> int:
    """A precision as a row's number (0: not known yet)."""
    return 0 if precision is None else PRECISIONS.index(precision) + 1


def from_code(value: int) -> Precision | None:
    """A row's number as a precision (``None`` for 0 or a number no precision has)."""
    return PRECISIONS[value - 1] if 1 <= value <= len(PRECISIONS) else None


def of_dtype(dtype: torch.dtype) -> Precision:
    """The precision a floating dtype computes in (fp32 for wider types too)."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "fp32"


def coarsest(precisions: list[Precision]) -> Precision:
    """The noisiest of several precisions (bf16 over fp16 over fp32)."""
    return max(precisions, key=PRECISIONS.index)
