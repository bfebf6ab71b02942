"""Tolerant mode's calibration: the replay noise of the pairs that will be compared, measured on
the first verifications, which can raise the threshold above the precision's floor.

Two measurements a verification step:

* **same device**: each rank replays its own probe twice (the noise of its own kernels);
* **cross rank**: each ring pair's distance (a verifier's replay of its source's claimed result).
  Ranks' kernels can differ where one rank's cannot (autotuning, ``cudnn.benchmark``, another
  driver or library on one node), so only pairs measure that.

Neither may be raised by a fault present from step 0: the same-device noise is the lower median
over ranks; for the cross-rank noise each rank takes the quieter of its two pairs (a faulty rank
makes both of its pairs loud, and only one pair of each neighbour), then the lower median over
ranks. A 2-rank ring has one pair per direction between the same two ranks, so its pairs cannot
tell a fault from noise: it calibrates on the same-device noise alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import calibration_noise


def cross_rank_noise(pair_distances: Sequence[float], ring: Ring) -> float:
    """One step's cross-rank noise: per rank the quieter of the pair it verified
    (``pair_distances[r]``) and the pair that verified it; the lower median over ranks.
    0 with fewer than 3 ranks."""
    world = len(pair_distances)
    if world < 3:
        return 0.0
    quiet = []
    for r in range(world):
        as_verifier, as_source = pair_distances[r], pair_distances[ring.verifier_of(r)]
        quiet.append(min(_finite(as_verifier), _finite(as_source)))
    return calibration_noise(quiet)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What tolerant mode has measured of its noise (part of the guard's state)."""

    verifications: int = 0
    """Calibration verifications done."""
    same_device: float = 0.0
    """Largest same-device noise of a step (lower median over ranks)."""
    cross_rank: float = 0.0
    """Largest cross-rank noise of a step (see :func:`cross_rank_noise`)."""

    @property
    def noise(self) -> float:
        """The noise the threshold is a margin over."""
        return max(self.same_device, self.cross_rank)

    def fold(self, noises: Sequence[float], pair_distances: Sequence[float], ring: Ring) -> Calibration:
        """This calibration with one more verification step's measurements."""
        return Calibration(
            verifications=self.verifications + 1,
            same_device=max(self.same_device, _finite_or_zero(calibration_noise(noises))),
            cross_rank=max(self.cross_rank, _finite_or_zero(cross_rank_noise(pair_distances, ring))),
        )

    def threshold(self, *, margin: float, floor: float, ceiling: float) -> float:
        """``margin`` × the noise, between ``floor`` and ``ceiling``."""
        return min(max(margin * self.noise, floor), ceiling)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Calibration:
        """A calibration from :meth:`to_dict`; a malformed one raises ``ValueError``."""
        try:
            verifications = data["verifications"]
            same, cross = data["same_device"], data["cross_rank"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a calibration: {data!r}") from exc
        if not isinstance(verifications, int) or isinstance(verifications, bool) or verifications < 0:
            raise ValueError(f"calibration verifications must be an int >= 0, got {verifications!r}")
        values = []
        for name, v in (("same_device", same), ("cross_rank", cross)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < math.inf:
                raise ValueError(f"calibration {name} must be a finite number >= 0, got {v!r}")
            values.append(float(v))
        return cls(verifications=verifications, same_device=values[0], cross_rank=values[1])


def _finite_or_zero(x: float) -> float:
    """A step's noise that is not finite came from a rank that failed its replay: it is not noise
    (the replay finding reports it), so it does not calibrate."""
    return x if math.isfinite(x) else 0.0
