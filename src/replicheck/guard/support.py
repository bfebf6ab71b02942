"""What the guard can guard: setups it refuses at construction with a message that says what to do,
and the checks of the user's own calls (the loss function's signature, optimizer steps taken
outside the guard).

Every check here looks only at the model's structure and the call's arguments, which are the
same on every rank, so every rank refuses alike and no rank is left in a collective.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard.errors import GuardConfigError, GuardMisuseError


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """Refuse ``torch.compile(ddp_model)`` clearly; any other model is returned as given."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, DistributedDataParallel):
        raise GuardConfigError(
            "torch.compile(ddp_model) is not supported: the guard needs DDP's own module for its "
            "replays and DDP's gradient hooks for its checks. Compile the module inside DDP instead: "
            "DistributedDataParallel(torch.compile(model))"
        )
    return model


def check_model(ddp: DistributedDataParallel | None, module: torch.nn.Module) -> None:
    """Refuse models whose forward communicates or whose DDP options bypass the guard's hooks."""
    sync_bn = [n for n, m in module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync_bn:
        raise GuardConfigError(
            f"SyncBatchNorm ({', '.join(sync_bn[:3])}) runs a collective inside forward, which the "
            "guard's probe and replays (run on some ranks only) cannot do without a hang or a false "
            "alarm. Use per-rank BatchNorm (nn.BatchNorm*d; the guard then uses probe='extra'), or "
            "GroupNorm/LayerNorm. Custom collectives inside forward are unsupported for the same reason."
        )
    if ddp is None:
        return
    if getattr(ddp, "static_graph", False):
        raise GuardConfigError(
            "DistributedDataParallel(static_graph=True) is not supported: the guard's probe adds "
            "backward passes under no_sync() that a static graph does not allow. Construct DDP "
            "without static_graph (use find_unused_parameters=True if parameters go unused)."
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise GuardConfigError(
            "DistributedDataParallel(mixed_precision=...) installs DDP's own communication hook, "
            "which would replace the guard's per-rank gradient checks. Use torch.autocast in the "
            "loss function for mixed precision instead."
        )


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


class StepGate:
    """Refuses ``optimizer.step()`` called outside the guard (it would apply an unchecked update).

    One gate per optimizer, shared by every guard built on it (a resumed job may build a new
    guard over the same optimizer): see :func:`step_gate`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.open = False
        self._handle = optimizer.register_step_pre_hook(self._pre)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.open:
            raise GuardMisuseError(
                "optimizer.step() was called outside Guard.step(): the guard already steps the "
                "optimizer once per step (a second call would apply the update twice, unchecked). "
                "Call only guard.step(batch)."
            )

    def remove(self) -> None:
        self._handle.remove()


_GATES: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepGate] = weakref.WeakKeyDictionary()


def step_gate(optimizer: torch.optim.Optimizer) -> StepGate:
    """The optimizer's gate, installed on first use."""
    gate = _GATES.get(optimizer)
    if gate is None:
        gate = _GATES[optimizer] = StepGate(optimizer)
    return gate
