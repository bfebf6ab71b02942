"""What the guard can guard: setups it refuses at construction with a message that says what to do,
and the checks of the user's own calls (the loss function's signature, the loss it returns).

Every check here looks only at the model's structure and the call's arguments, which are the
same on every rank, so every rank refuses alike and no rank is left in a collective.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from replicheck.guard.errors import GuardConfigError, GuardMisuseError


def check_model(module: torch.nn.Module) -> None:
    """Refuse models whose forward communicates (each parallelism refuses its own options)."""
    sync_bn = [n for n, m in module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync_bn:
        raise GuardConfigError(
            f"SyncBatchNorm ({', '.join(sync_bn[:3])}) runs a collective inside forward, which the "
            "guard's probe and replays (run on some ranks only) cannot do without a hang or a false "
            "alarm. Use per-rank BatchNorm (nn.BatchNorm*d; the guard then uses probe='extra'), or "
            "GroupNorm/LayerNorm. Custom collectives inside forward are unsupported for the same reason."
        )


def resolve_optimizer(optimizer: object, scaler: object = None) -> torch.optim.Optimizer:
    """The torch optimizer the guard steps: ``optimizer`` itself, or the one a delegating wrapper
    holds in ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``, a trainer's wrapper), which
    the guard then steps directly. A wrapper with a loss scaler of its own is refused: stepping
    the inner optimizer would bypass that scaler."""
    seen: list[object] = []
    current = optimizer
    # A wrapper may itself subclass torch.optim.Optimizer without being one in substance
    # (Accelerate's AcceleratedOptimizer never runs Optimizer.__init__): descend while there is
    # an inner optimizer, whatever the wrapper's class.
    while (inner := getattr(current, "optimizer", None)) is not None:
        if len(seen) >= 4 or any(inner is s for s in seen):
            break
        own = getattr(current, "scaler", None)
        if own is not None and own is not scaler:
            raise GuardConfigError(
                f"{type(current).__name__} steps through a loss scaler of its own, which the guard "
                "would bypass: pass its .optimizer and the scaler as Guard(..., scaler=...)"
            )
        seen.append(current)
        current = inner
    if not isinstance(current, torch.optim.Optimizer) or inner is not None:
        raise GuardConfigError(
            f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one in "
            f".optimizer), got {type(optimizer).__name__}"
        )
    return current


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose state is not replicated, so comparing it across ranks means nothing."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch build without distributed support has no ZeRO either
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise GuardConfigError(
            "ZeroRedundancyOptimizer shards the optimizer state across ranks, so the guard's "
            "cross-replica optimizer-state check would compare nothing. Use a replicated optimizer "
            "(for example torch.optim.AdamW) with the guard."
        )


def check_loss_fn(loss_fn: Callable[..., Any]) -> None:
    """``loss_fn(module, batch)``: refuse a callable that cannot take exactly these two arguments."""
    if not callable(loss_fn):
        raise GuardConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call will tell
    try:
        sig.bind(object(), object())
    except TypeError as exc:
        raise GuardConfigError(
            f"loss_fn must accept (module, batch) and return the scalar loss; "
            f"{getattr(loss_fn, '__name__', loss_fn)!r}{sig} does not: {exc}"
        ) from None


def checked_loss(loss: object, where: str) -> torch.Tensor:
    """The loss as returned by ``loss_fn``, refused unless it is a scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise GuardMisuseError(f"loss_fn must return a scalar floating-point tensor ({where}); got {what}")
    return loss
