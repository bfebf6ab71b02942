"""The guard in a Hugging Face Accelerate loop.

Accelerate accumulates with ``with accelerator.accumulate(model):`` around each micro-batch: a
backward per micro-batch under DDP's ``no_sync`` and an optimizer step only when
``accelerator.sync_gradients``. The guard owns the optimizer step and runs the accumulation
itself, so the loop hands it a whole window at once::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = guard_for(accelerator, model, optimizer, loss_fn, GuardConfig(max_grad_norm=1.0))
    for window in windows(loader, accelerator):
        result = guard.step(*window)
        scheduler.step()
        optimizer.zero_grad()

What maps to what, and why it is the same update (``docs/integrations.md``, "Accelerate"):

* ``accelerator.backward(loss)`` divides each micro-batch's loss by
  ``gradient_accumulation_steps``; the guard weighs each micro-batch's plain loss by its share
  of the window's samples, the same factor for equal micro-batches.
* ``accelerator.clip_grad_norm_(params, max_norm)`` under ``if accelerator.sync_gradients``:
  ``GuardConfig(max_grad_norm=max_norm)``.
* ``accelerator.accumulate`` itself is refused by the guard (``GuardMisuseError``: gradient sync
  off), before any pass can look like hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from replicheck.integrations import require

require("accelerate", "accelerate")

import accelerate  # noqa: E402 - after the clear ImportError above

from replicheck.guard import Guard, GuardConfig, GuardConfigError  # noqa: E402
from replicheck.guard.loss import LossFn  # noqa: E402

__all__ = ["guard_for", "windows"]

# Where the guard owns the gradient reduction: plain processes and DDP (one process per device),
# or torch's own FSDP2. DeepSpeed, Megatron and FSDP1 reduce inside their own engines.
_SUPPORTED = frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"})


def windows(batches: Iterable[Any], accelerator: accelerate.Accelerator | int) -> Iterator[tuple[Any, ...]]:
    """Group ``batches`` into the micro-batches of one optimizer step each.

    ``accelerator``: the Accelerator (its ``gradient_accumulation_steps``) or the count itself.
    The last window is shorter when the batches do not divide evenly: a prepared loader's end
    also ends Accelerate's window (``sync_with_dataloader``). There Accelerate still divides each
    loss by the full ``gradient_accumulation_steps``, while the guard weighs the short window's
    micro-batches by their own share: the updates differ on that step only, and not at all with
    ``drop_last`` or a length that divides.
    """
    steps = accelerator if isinstance(accelerator, int) else accelerator.gradient_accumulation_steps
    if steps < 1:
        raise GuardConfigError(f"gradient_accumulation_steps must be >= 1, got {steps}")
    window: list[Any] = []
    for batch in batches:
        window.append(batch)
        if len(window) == steps:
            yield tuple(window)
            window = []
    if window:
        yield tuple(window)


def guard_for(
    accelerator: accelerate.Accelerator,
    model: Any,
    optimizer: Any,
    loss_fn: LossFn,
    config: GuardConfig | None = None,
    *,
    node: str | None = None,
) -> Guard:
    """A :class:`~replicheck.guard.Guard` over what ``accelerator.prepare`` returned.

    With ``mixed_precision="fp16"`` the guard steps through the accelerator's ``GradScaler``
    (the wrapped optimizer is unwrapped and the scaler passed as ``scaler=``). ``config`` is
    used as given: declare ``loss_reduction="sample_mean"`` (or return a ``LossSum``) only when
    the loss really is a per-sample mean, which lets the probe be split off the batch.
    Refused (``GuardConfigError``): engines that reduce gradients themselves (DeepSpeed,
    Megatron-LM, FSDP1, XLA).
    """
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    fsdp2 = kind == "FSDP" and getattr(accelerator.state, "is_fsdp2", False)
    if kind not in _SUPPORTED and not fsdp2:
        raise GuardConfigError(
            f"Accelerate's {kind} reduces gradients inside its own engine, where the guard cannot check "
            "them: run the guard with DDP (the default multi-process setup) or FSDP2 (fsdp_version=2)"
        )
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        optimizer = getattr(optimizer, "optimizer", optimizer)
    return Guard(model, optimizer, loss_fn, config, node, scaler=scaler)
