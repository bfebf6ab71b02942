"""What a tolerant-mode job computes in, learnt from its first forward, and the tolerances that
follow (:mod:`replicheck.guard.tolerance`), logged once."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from replicheck.guard import tolerance as tol
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardMisuseError

log = logging.getLogger("replicheck.guard")


def autocast_precision(device_type: str) -> tol.Precision | None:
    """The autocast precision in force for ``device_type`` now, or ``None`` outside autocast."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return tol.of_dtype(torch.get_autocast_dtype(device_type))


def parameter_precision(params: Sequence[torch.nn.Parameter]) -> tol.Precision:
    """The noisiest precision among the floating parameters (fp32 when there are none)."""
    found = [tol.of_dtype(p.dtype) for p in params if p.is_floating_point()]
    return tol.coarsest(found) if found else "fp32"


def _output_precision(out: Any) -> tol.Precision | None:
    """The precision of the first floating tensor of a module's output (a tensor, a mapping such
    as a Hugging Face output, or a sequence), or ``None``."""
    if isinstance(out, torch.Tensor):
        return tol.of_dtype(out.dtype) if out.is_floating_point() else None
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        found = _output_precision(v)
        if found is not None:
            return found
    return None


class ToleranceState:
    """This rank's tolerances in tolerant mode: its precision (set, or learnt from the first
    forward of the bare module: the autocast dtype in force, the parameters' dtype, the output's),
    the table's choices for what the user left ``None``, and one log line saying so."""

    def __init__(
        self,
        config: GuardConfig,
        module: torch.nn.Module,
        device: torch.device,
        params: Sequence[torch.nn.Parameter],
        rank: int,
    ) -> None:
        self._config, self._rank = config, rank
        self._device_type = device.type
        self._params = list(params)
        self._seen: tol.Precision | None = None if config.precision == "auto" else config.precision
        self._resolved: tol.Tolerance | None = None
        self._handles: list[Any] = []
        if config.mode == "tolerant" and self._seen is None:
            self._handles = [
                module.register_forward_pre_hook(self._before),
                module.register_forward_hook(self._after),
            ]
        elif config.mode == "tolerant":
            self.tolerance()  # set by the user: say so at start-up

    @property
    def precision(self) -> tol.Precision | None:
        """The precision learnt or set (``None`` before the first forward of an ``auto`` job)."""
        return self._seen

    def _before(self, _module: torch.nn.Module, _args: Any) -> None:
        found = autocast_precision(self._device_type) or parameter_precision(self._params)
        self._seen = found if self._seen is None else tol.coarsest([self._seen, found])

    def _after(self, _module: torch.nn.Module, _args: Any, out: Any) -> None:
        found = _output_precision(out)
        if found is not None and self._seen is not None:
            self._seen = tol.coarsest([self._seen, found])
        for h in self._handles:  # learnt: the hooks cost nothing from now on
            h.remove()
        self._handles = []

    def tolerance(self) -> tol.Tolerance:
        """This rank's tolerances (decided at the first call, after the first forward)."""
        if self._resolved is None:
            precision = self._seen if self._seen is not None else parameter_precision(self._params)
            self._seen = precision
            self._resolved = self.for_precision(precision, announce=True)
        return self._resolved

    def for_precision(self, precision: tol.Precision, *, announce: bool = False) -> tol.Tolerance:
        """The tolerances of ``precision`` under this configuration; ``announce``: log the choice
        and warn about set values the measured noise can exceed (rank 0)."""
        cfg = self._config
        chosen, problems = tol.choose(
            precision, sketch_block=cfg.sketch_block, floor=cfg.tolerance_floor, ceiling=cfg.tolerance_ceiling
        )
        if announce and self._rank == 0:
            log.info("replicheck: %s", chosen.describe())
            for text in problems:
                log.warning("replicheck: %s", text)
                warnings.warn(f"replicheck: {text}", stacklevel=4)
        return chosen

    def agreed(self, codes: Sequence[int]) -> tol.Tolerance:
        """The tolerances of a verification step from every rank's precision (its row): the same
        on every rank. Ranks that compute in different precisions cannot be compared in tolerant
        mode: a misuse, raised on every rank."""
        seen = {tol.from_code(c) for c in codes}
        if None in seen or len(seen) != 1:
            names = ", ".join(f"rank {r}: {tol.from_code(c) or 'unknown'}" for r, c in enumerate(codes))
            raise GuardMisuseError(
                "tolerant mode compares ranks that compute in the same precision; the ranks of this "
                f"job differ ({names}). Use the same autocast on every rank, or set "
                "GuardConfig(precision=...)."
            )
        (precision,) = seen
        assert precision is not None
        if precision == self.tolerance().precision:
            return self.tolerance()
        return self.for_precision(precision)
