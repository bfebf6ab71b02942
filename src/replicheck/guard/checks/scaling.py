"""A dynamic loss scaler (``torch.amp.GradScaler``, fp16 training) under the guard.

The scaler makes non-finite gradients on purpose: when the scaled loss overflows, it skips the
step and lowers the scale. The guard tells such an overflow from corruption the way it tells
data-borne faults from hardware: the overflowing rank's passes are re-run on another rank with
the same scale. Reproduced there (or most ranks overflowing at once) it is the scaler's overflow:
every rank skips the step as the scaler does (its update is never applied) and the scale falls
identically everywhere. An overflow one rank sees and no other can reproduce is corruption.

The scale is a power of two, so scaling a loss by it is exact: a replay with ``weight × scale``
gives the bits the scaled pass gave.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.errors import GuardConfigError


def checked_scaler(scaler: object) -> torch.amp.GradScaler | None:
    """The scaler the guard drives, or ``None`` when none is given or it is disabled."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise GuardConfigError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    return scaler if scaler.is_enabled() else None


def scale_tensor(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """The current scale as a float64 0-dim tensor on ``device``, without a host transfer."""
    return scaler.scale(torch.ones((), dtype=torch.float64, device=device))


def state_digest(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Digest of the scaler's state (scale, growth tracker, factors): replicas must agree on it."""
    state = scaler.state_dict()
    values = [float(state[k]) for k in sorted(state)]
    return fp.digest(torch.tensor(values, dtype=torch.float64))


def is_overflow(findings: Sequence[Finding], world_size: int) -> bool:
    """The step's findings are a loss-scale overflow the scaler skips, and nothing else.

    That is a gradient finding whose alarming ranks all had non-finite gradients, reproduced by
    another rank (``data``) or on most ranks at once (``divergence``); with a single rank, where no
    other device can re-run the work, reproduced by the rank itself. A replay finding on such a
    step is set aside: no update of the step is applied, and the next verification checks again.
    """
    grads = [f for f in findings if f.check == "gradients"]
    if len(grads) != 1 or any(f.check not in ("gradients", "replay") for f in findings):
        return False
    finding = grads[0]
    reproduced = ("data", "divergence") + (("persistent",) if world_size == 1 else ())
    if finding.classification not in reproduced:
        return False
    listed = finding.evidence.get("local_grad_norms")
    norms = [float(n) for n in listed if isinstance(n, (int, float))] if isinstance(listed, list) else []
    found = finding.evidence.get("bound")
    bound = float(found) if isinstance(found, (int, float)) else None
    bad = [n for n in norms if not math.isfinite(n) or (bound is not None and n > bound)]
    return bool(bad) and not any(math.isfinite(n) for n in bad)


def skip(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Skip the step as the scaler would: record its inf check, lower the scale, apply nothing.

    ``optimizer.step`` is never called, so no update is applied whatever the check finds. Returns
    whether the scaler itself found the overflow (the scale went down); it always should, since the
    all-reduce carries a rank's inf into every rank's gradient.
    """
    before = scaler.get_scale()
    scaler.unscale_(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < before
