"""Lightning's automatic optimisation under the guard: one strategy object in the ``Trainer``.

``Trainer(strategy=GuardedDDPStrategy(guard_config=GuardConfig(...)), ...)`` is Lightning's DDP
strategy whose optimizer step is :meth:`Guard.step <replicheck.guard.Guard.step>`. Lightning keeps
its loop: ``LightningOptimizer.step`` (so ``global_step``, ``max_steps`` and the LR schedulers
count as usual) calls the strategy's ``optimizer_step``, which hands the batch to the guard
instead of calling ``optimizer.step(closure)``. What Lightning runs around that call is mapped:

* the training pass is Lightning's own closure (``training_step`` through the DDP wrapper with
  Lightning's hooks, ``self.log``, ``on_before_zero_grad``/``optimizer_zero_grad`` and
  ``on_before_backward``); its backward is the guard's, so the guard's checks see it;
* the probe and every replay (another rank's probe, a re-run) call the bare
  ``training_step`` with ``self.log`` silenced: they must not log a probe or another rank's batch;
* ``on_after_backward``, ``on_before_optimizer_step`` and the clipping of
  ``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`` (``configure_gradient_clipping``)
  run as one gradient edit of the guard: on every rank, after the step's checks passed, on the
  reduced gradient, before ``optimizer.step()``, in Lightning's order.

What cannot be run exactly is refused before training (:class:`GuardConfigError`, every rank
alike). On corruption, :class:`~replicheck.guard.CorruptionDetected` leaves ``trainer.fit`` on every
rank after Lightning's own exception handling; decorate ``main`` with
:func:`replicheck.elastic.guarded_main` for the summary, torchrun's error file and exit code 87.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from replicheck.integrations import require

require("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402 - after the check that names the extra
import torch  # noqa: E402
from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.loops.optimization.automatic import Closure  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature  # noqa: E402

from replicheck.guard import (  # noqa: E402
    Guard,
    GuardConfig,
    GuardConfigError,
    GuardMisuseError,
    StepResult,
    current_pass,
    is_replaying,
)

__all__ = ["CHECKPOINT_KEY", "GuardedDDPStrategy"]

CHECKPOINT_KEY = "replicheck_guard"
"""Where the guard's own state (:meth:`Guard.state_dict`) is kept in a Lightning checkpoint."""

_COMM_OPTIONS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class GuardedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose optimizer step runs through a :class:`~replicheck.guard.Guard`.

    ``guard_config`` configures the guard (``probe="auto"`` runs as ``"extra"``: Lightning's
    training pass must see the whole batch once); every other argument is ``DDPStrategy``'s.
    The guard is built in :meth:`setup` on every rank, over the DDP-wrapped module and the one
    optimizer of ``configure_optimizers``; :attr:`guard` and :attr:`last_result` expose it.
    """

    def __init__(self, *args: Any, guard_config: GuardConfig | None = None, **kwargs: Any) -> None:
        for name in _COMM_OPTIONS:
            if kwargs.get(name) is not None:
                raise GuardConfigError(
                    f"GuardedDDPStrategy({name}=...): the guard needs DDP's communication hook slot to "
                    "check each rank's gradient before the all-reduce, and the weights to change only "
                    "through its optimizer step. Remove the option."
                )
        super().__init__(*args, **kwargs)
        self._guard_config = _checked_config(guard_config)
        self._guard: Guard | None = None
        self.last_result: StepResult | None = None
        """The last :class:`~replicheck.guard.StepResult` (loss, step, verified, ...)."""
        self._batch: Any = None
        self._batch_idx = 0
        self._closure: Closure | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._backward_loss: torch.Tensor | None = None
        self._step_output: Any = None
        self._pending_state: dict[str, Any] | None = None

    # -- what Lightning calls ---------------------------------------------------------------
    @property
    def guard(self) -> Guard | None:
        """The guard (built in :meth:`setup` when fitting; ``None`` before)."""
        return self._guard

    def setup_environment(self) -> None:
        # Called after the Trainer attached the module, before the process group or any pass:
        # the refusals that need only the Trainer's settings come here, on every rank alike.
        self._refuse_trainer()
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        self._refuse_trainer()
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise GuardConfigError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers: the guard steps exactly "
                "one (automatic optimisation). Put every parameter group in one optimizer."
            )
        optimizer = self.optimizers[0]
        if isinstance(optimizer, torch.optim.LBFGS):
            raise GuardConfigError(
                "LBFGS re-evaluates the loss inside optimizer.step(closure); the guard steps the "
                "optimizer once, without a closure, after its checks. Use a first-order optimizer."
            )
        model = self.model
        if model is None:
            raise GuardConfigError("internal: the strategy has no model after setup")
        guard = Guard(model, optimizer, self._loss, config=self._guard_config)
        guard.add_gradient_edit(self._after_backward)
        if self._pending_state is not None:
            guard.load_state_dict(self._pending_state)
            self._pending_state = None
        self._guard = guard

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The batch Lightning's closure will train on (on the device, after the transfer hooks).
        self._batch, self._batch_idx = batch, batch_idx

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """``guard.step(batch)`` in place of ``optimizer.step(closure)``; returns what the
        latter returns (the closure's detached loss)."""
        guard = self._guard
        if guard is None:
            raise GuardMisuseError("GuardedDDPStrategy.optimizer_step before setup built the guard")
        if kwargs:
            raise GuardMisuseError(
                f"optimizer.step() arguments {sorted(kwargs)}: the guard steps the optimizer without arguments"
            )
        if not isinstance(closure, Closure):
            raise GuardMisuseError(
                "optimizer_step was given a closure that is not Lightning's training closure (an "
                "optimizer_step override that wraps or drops it?): pass optimizer_closure on as "
                "optimizer.step(closure=optimizer_closure), unchanged."
            )
        if closure._backward_fn is None:
            raise GuardMisuseError(
                "Lightning asked for a step without backward (StochasticWeightAveraging's last "
                "epoch?): the guard runs the backward of every step it checks."
            )
        self._closure, self._optimizer = closure, optimizer
        self._backward_loss, self._step_output = None, None
        try:
            self.last_result = guard.step(self._batch)
        finally:
            self._closure, self._backward_loss = None, None
        return self._step_output

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self._guard is not None:
            checkpoint[CHECKPOINT_KEY] = self._guard.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        if isinstance(state, dict):
            # Lightning loads a checkpoint before setup builds the guard: kept until then.
            if self._guard is not None:
                self._guard.load_state_dict(state)
            else:
                self._pending_state = state
        return checkpoint

    # -- the guard's loss function ----------------------------------------------------------
    def _loss(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn(module, batch)`` of the guard: Lightning's closure on the training pass,
        the bare ``training_step`` (``self.log`` silenced) on every other pass."""
        if current_pass() == "train" and not is_replaying():
            return self._training_pass(module)
        lm = self._module()
        args = self._step_args(batch)
        with self.precision_plugin.train_step_context(), _silenced(lm):
            if module is lm:
                out = lm.training_step(*args)
            else:
                # A wrapper (DDP, on the pass that settles its buckets after a resume): through
                # its forward, as Lightning's strategy calls training_step.
                out = self._forward_redirection(module, lm, "training_step", *args)
        return _loss_of(out)

    def _training_pass(self, module: torch.nn.Module) -> torch.Tensor:
        closure = self._closure
        if closure is None or module is not self.model:
            raise GuardMisuseError("internal: a training pass outside GuardedDDPStrategy.optimizer_step")
        lm = self._module()
        captured: list[torch.Tensor] = []

        def backward(loss: torch.Tensor) -> None:
            # Lightning's backward minus the backward itself, which the guard runs (checked):
            # the precision plugin's pre_backward runs the on_before_backward hooks.
            captured.append(self.precision_plugin.pre_backward(loss, lm))

        saved = closure._backward_fn
        closure._backward_fn = backward
        try:
            # training_step through the strategy (and the DDP wrapper), the zero_grad hooks,
            # and the closure's result set for Lightning's consume_result() after the step.
            self._step_output = closure()
        finally:
            closure._backward_fn = saved
        if not captured:
            raise GuardMisuseError(
                "training_step returned None: skipping a step is not supported under the guard"
            )
        self._backward_loss = captured[0]
        return captured[0]

    def _after_backward(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The guard's gradient edit: what Lightning runs between the backward and
        ``optimizer.step()``, on the reduced gradient of a step that passed its checks."""
        lm = self._module()
        optimizer = self._optimizer
        if optimizer is None:
            raise GuardMisuseError("internal: a gradient edit outside GuardedDDPStrategy.optimizer_step")
        if self._backward_loss is not None:
            with torch.enable_grad():  # as in Lightning's closure
                self.precision_plugin.post_backward(self._backward_loss, lm)  # on_after_backward
        # on_before_optimizer_step (callbacks, then the module), then configure_gradient_clipping
        # with the Trainer's gradient_clip_val / gradient_clip_algorithm.
        self.precision_plugin._after_closure(lm, optimizer)

    def _step_args(self, batch: Any) -> tuple[Any, ...]:
        """``training_step``'s arguments, as Lightning builds them (``batch_idx`` when it takes one)."""
        lm = self._module()
        if is_param_in_hook_signature(lm.training_step, "batch_idx", min_args=2):
            return (batch, self._batch_idx)
        return (batch,)

    def _module(self) -> pl.LightningModule:
        lm = self.lightning_module
        if lm is None:
            raise GuardMisuseError("internal: no LightningModule attached to the strategy")
        return lm

    # -- refusals ---------------------------------------------------------------------------
    def _refuse_trainer(self) -> None:
        """Refuse what the guard cannot run exactly as Lightning would, before any pass (when
        fitting: validate, test and predict never step the optimizer)."""
        lm = self._module()
        trainer = lm.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not lm.automatic_optimization:
            raise GuardConfigError(
                "manual optimisation (automatic_optimization = False): the guard owns the optimizer "
                "step, which training_step would then call itself. Use automatic optimisation, or a "
                "plain loop with guard.step(batch)."
            )
        if trainer.accumulate_grad_batches != 1:
            raise GuardConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): Lightning would step "
                "the optimizer once per several training_step calls, each its own closure, while the "
                "guard checks one step of all its micro-batches at once. Use a larger batch, or the "
                "plain loop with guard.step(mb1, mb2, ...)."
            )
        precision = self.precision_plugin
        if getattr(precision, "scaler", None) is not None:
            raise GuardConfigError(
                f"precision={getattr(precision, 'precision', type(precision).__name__)!r} steps through a "
                "GradScaler inside Lightning's precision plugin, which the guard's step would bypass. Use "
                "precision='bf16-mixed' (no scaler) or 32-bit, or the plain loop with Guard(scaler=...)."
            )
        if type(precision).optimizer_step is not Precision.optimizer_step and not isinstance(
            precision, MixedPrecision
        ):
            raise GuardConfigError(
                f"the precision plugin {type(precision).__name__} runs an optimizer step of its own, "
                "which the guard's step would bypass. Use 32-bit, 64-bit, '16-true', 'bf16-true' or "
                "'bf16-mixed' precision."
            )
        if is_overridden("backward", lm):
            raise GuardConfigError(
                f"{type(lm).__name__}.backward is overridden: the guard runs each backward itself "
                "(loss.backward() under its checks), so the override would not run."
            )
        if is_param_in_hook_signature(lm.training_step, "dataloader_iter", explicit=True):
            raise GuardConfigError(
                "training_step(dataloader_iter): the guard needs the step's batch (its probe is taken "
                "from it). Take the batch as training_step(batch, batch_idx)."
            )
        swa = [c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]  # type: ignore[attr-defined]
        if swa:
            raise GuardConfigError(
                "StochasticWeightAveraging replaces the weights outside the optimizer step and runs "
                "steps without backward: not supported under the guard. Keep an average of the "
                "weights in a separate copy (on_train_batch_end) instead."
            )


def _checked_config(config: GuardConfig | None) -> GuardConfig:
    cfg = config if config is not None else GuardConfig()
    if not isinstance(cfg, GuardConfig):
        raise GuardConfigError(f"guard_config must be a GuardConfig, got {type(cfg).__name__}")
    if cfg.probe == "split":
        raise GuardConfigError(
            "GuardConfig(probe='split') under Lightning: Lightning's training pass runs training_step "
            "on the whole batch once, so the probe cannot be part of it. Use probe='auto' or 'extra'."
        )
    if cfg.max_grad_norm is not None:
        raise GuardConfigError(
            "GuardConfig(max_grad_norm=...) under Lightning: clip with Trainer(gradient_clip_val=...), "
            "which the guard runs as Lightning does (after on_before_optimizer_step)."
        )
    # The training pass sees the whole batch (Lightning's closure): the probe is computed in addition.
    return dataclasses.replace(cfg, probe="extra")


def _loss_of(out: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output (a tensor, or a dict's ``"loss"``)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise GuardMisuseError(
            f"training_step must return the loss (a tensor, or a dict with 'loss'), got {type(out).__name__}"
        )
    return loss


def _silent(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _silenced(module: pl.LightningModule) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside: a probe or a replay (another
    rank's batch) must not reach the Trainer's metrics."""
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.__dict__["log"] = _silent
    module.__dict__["log_dict"] = _silent
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                module.__dict__[name] = saved[name]
            else:
                del module.__dict__[name]
