"""``GuardedTrainer``: a drop-in :class:`transformers.Trainer` whose every optimizer step runs
through :class:`~replicheck.guard.Guard` (``pip install 'replicheck[transformers]'``).

How the Trainer's loop maps onto the guard (``docs/integrations.md``, "Hugging Face Transformers"):

* The Trainer calls :meth:`GuardedTrainer.training_step` once per micro-batch, the earlier ones
  inside ``no_sync``. The micro-batches are held until the one that ends the accumulation window
  (``accelerator.sync_gradients``), which runs outside ``no_sync`` and hands the whole window to
  one ``guard.step(mb1, mb2, ...)``: the guard runs the passes, the checks, the clipping and the
  optimizer step. The held micro-batches return a zero loss and the last one the window's, so the
  Trainer's logged ``loss`` is the stock one.
* The loss: the model's own loss as a sum with its label-token count, per micro-batch (a
  :class:`~replicheck.guard.LossSum`) when the model takes ``num_items_in_batch``, as the stock
  Trainer normalises it (``average_tokens_across_devices`` becomes
  ``GuardConfig.global_item_count``); else ``compute_loss`` as a per-micro-batch mean.
* ``args.max_grad_norm`` becomes ``GuardConfig.max_grad_norm``; the Trainer's own clipping returns
  the guard's pre-clip norm instead of clipping again, so ``grad_norm`` is logged as stock.
* ``self.optimizer`` is replaced, once the guard exists, by a proxy whose ``step()`` only checks
  that the guard stepped in this window (the guard's gate refuses any other step).
* Checkpoints hold the guard's state (``replicheck_guard_state.json``); a resumed run continues
  the guard's schedule at ``state.global_step``.
* A detection ends the process: the summary, torchrun's error file and exit code 87
  (:func:`replicheck.elastic.exit_on_corruption`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from typing import Any, cast

from replicheck.integrations import require

require("transformers", "transformers")

import torch  # noqa: E402 - after the check that names the extra
from transformers import Trainer  # noqa: E402

from replicheck.elastic import exit_on_corruption  # noqa: E402
from replicheck.guard import (  # noqa: E402
    CorruptionDetected,
    Guard,
    GuardConfig,
    GuardConfigError,
    GuardMisuseError,
    LossSum,
    StepResult,
)

log = logging.getLogger(__name__)

GUARD_STATE_NAME = "replicheck_guard_state.json"
"""The guard's state inside a Trainer checkpoint folder (``checkpoint-<step>/``)."""

_IGNORE_INDEX = -100  # the label the Trainer's token count and Hugging Face's losses skip


class GuardedTrainer(Trainer):
    """A :class:`transformers.Trainer` whose optimizer steps are checked by the guard.

    Everything the stock Trainer takes is taken alike; ``guard_config`` configures the guard,
    except what the Trainer decides: ``max_grad_norm`` (``TrainingArguments.max_grad_norm``),
    ``global_item_count`` (``average_tokens_across_devices``), ``loss_reduction`` (from the
    loss, see :meth:`training_step`) and ``start_step`` (the global step, restored with the
    guard's state from a checkpoint). ``exit_on_corruption``
    (default ``True``): a detection prints its summary, records it in torchrun's error file and
    exits 87; ``False`` re-raises :class:`~replicheck.guard.CorruptionDetected` instead.

    The guard is built at the first training step, on every rank alike, over the prepared model
    (DDP under several processes) and the Trainer's torch optimizer; it is :attr:`guard` from
    then on. Setups whose step the guard cannot own exactly are refused with a
    :class:`~replicheck.guard.GuardConfigError` before training starts (see :meth:`check_supported`).
    """

    def __init__(
        self,
        *args: Any,
        guard_config: GuardConfig | None = None,
        exit_on_corruption: bool = True,
        **kwargs: Any,
    ) -> None:
        if guard_config is not None and not isinstance(guard_config, GuardConfig):
            raise GuardConfigError(f"guard_config must be a GuardConfig, got {type(guard_config).__name__}")
        super().__init__(*args, **kwargs)
        self._guard_config = guard_config if guard_config is not None else GuardConfig()
        self._exit_on_corruption = exit_on_corruption
        self._guard: Guard | None = None
        self._window: list[Any] = []  # the prepared micro-batches of the window being accumulated
        self._result: StepResult | None = None  # the guard's result for this window, until stepped
        self._accelerated: Any = None  # the Trainer's optimizer, while the proxy stands in for it
        self._saved_state: dict[str, Any] | None = None  # guard state read from a checkpoint
        self.check_supported()

    # -- public -----------------------------------------------------------------------------
    @property
    def guard(self) -> Guard | None:
        """The guard of the current (or last) ``train()``; ``None`` before its first step."""
        return self._guard

    def check_supported(self) -> None:
        """Refuse, with a :class:`~replicheck.guard.GuardConfigError` saying what to do, what the
        guard cannot own exactly (called at construction and again by :meth:`train`)."""
        args = self.args
        refusals: list[str] = []
        if args.fp16:
            refusals.append(
                "fp16 training steps through a GradScaler the Trainer owns; use bf16=True (no scaler) "
                "or the guard directly with Guard(..., scaler=GradScaler())"
            )
        if self.is_deepspeed_enabled:
            refusals.append("DeepSpeed owns the backward and the optimizer step; use DDP (torchrun) instead")
        if self.is_fsdp_enabled:
            refusals.append(
                "FSDP through the Trainer is not supported by GuardedTrainer; use DDP, or the guard "
                "directly over fully_shard (FSDP2)"
            )
        if args.n_gpu > 1:
            refusals.append(
                "nn.DataParallel (several GPUs in one process): launch one process per GPU with torchrun"
            )
        if max(self.get_tp_size(), self.get_cp_size(), self.get_sp_size()) > 1:
            refusals.append(
                "tensor, context or sequence parallelism: only data parallelism (DDP) is supported"
            )
        if args.label_smoothing_factor != 0:
            refusals.append(
                "label_smoothing_factor != 0: the label smoother replaces the model's loss with "
                "its own normalisation, which the guard's per-pass loss does not reproduce; put "
                "the smoothing into the model's loss or leave it at 0"
            )
        if self.compute_loss_func is not None:
            refusals.append(
                "compute_loss_func: fold the loss into the model, or override compute_loss to return "
                "a per-micro-batch mean and set loss_is_scaled_for_ga = False"
            )
        if "lomo" in str(getattr(args.optim, "value", args.optim)).lower():
            refusals.append("LOMO optimizers update inside backward, before the guard's checks")
        if self._guard_config.start_step != 0:
            refusals.append(
                "guard_config.start_step: the guard's first step is the Trainer's global step "
                "(resume with train(resume_from_checkpoint=...))"
            )
        wanted = self._max_grad_norm()
        given = self._guard_config.max_grad_norm
        if given is not None and given != wanted:
            refusals.append(
                f"guard_config.max_grad_norm={given} but TrainingArguments.max_grad_norm="
                f"{args.max_grad_norm}: set the clipping once, in TrainingArguments.max_grad_norm"
            )
        if self._custom_compute_loss() or not self.model_accepts_loss_kwargs:
            # compute_loss is the guard's loss (the model's own token sum is not available).
            refusal = self._mean_loss_refusal(has_labels=True)
            if refusal is not None:
                refusals.append(refusal)
        if refusals:
            raise GuardConfigError("GuardedTrainer cannot guard this setup: " + "; ".join(refusals))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``train()``, every optimizer step through a guard built at its first step;
        a detection exits 87 (see the class docstring)."""
        self.check_supported()
        self._guard, self._window, self._result, self._saved_state = None, [], None, None
        try:
            return super().train(*args, **kwargs)
        except CorruptionDetected as exc:
            if self._exit_on_corruption:
                exit_on_corruption(exc.incident)
            raise
        finally:
            self._window = []
            if self._accelerated is not None:
                # Later calls (evaluate, save, another train) see the Trainer's own optimizer.
                self.optimizer, self._accelerated = self._accelerated, None
                self.callback_handler.optimizer = self.optimizer

    # -- the Trainer's hooks ----------------------------------------------------------------
    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Hold the micro-batch; on the window's last one run the guarded step over all of them.

        Returns the loss the stock Trainer would add to its running total: 0 for a held
        micro-batch, the window's loss (this rank's, normalised as the stock Trainer
        normalises it) for the last. ``num_items_in_batch`` is not used: each pass reports its
        own item count and the guard sums them (over every rank with a global count).
        """
        model.train()
        optimizer: Any = self.optimizer
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()  # schedule-free optimizers have modes, as in the stock step
        self._window.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batches, self._window = self._window, []
        guard = self._guard if self._guard is not None else self._build_guard(model, batches[0])
        if guard.next_step != self.state.global_step:
            raise GuardMisuseError(
                f"the guard's next step is {guard.next_step} but the Trainer is at global step "
                f"{self.state.global_step}: they must advance together"
            )
        self._result = guard.step(*batches)
        return torch.tensor(self._result.loss, dtype=torch.float32, device=self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """The guard clipped already: its pre-clip norm of this step, as the stock Trainer logs it."""
        result = self._result
        if result is None or result.grad_norm is None:
            # No clipping in the guard (max_grad_norm = inf): the stock call only measures.
            return super()._clip_grad_norm(model)
        return torch.tensor(result.grad_norm, device=self.args.device)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The stock optimizer and scheduler state, then the guard's (one file, from the process
        that saves the model: the state is the same on every rank)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self._guard is None or not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, GUARD_STATE_NAME)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self._guard.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The stock optimizer and scheduler state, and the guard's when the checkpoint has it
        (restored into the guard when it is built, at the first step)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, GUARD_STATE_NAME)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                self._saved_state = json.load(fh)
            if self._guard is not None:
                self._guard.load_state_dict(self._saved_state)

    # -- the guard --------------------------------------------------------------------------
    def _build_guard(self, model: torch.nn.Module, first: Any) -> Guard:
        """The guard over the prepared model and the Trainer's torch optimizer (every rank alike:
        its constructor runs a collective), with the proxy put in the optimizer's place."""
        has_labels = isinstance(first, dict) and "labels" in first
        sums = self._sums_tokens(first)
        refusal = None if sums else self._mean_loss_refusal(has_labels)
        if sums and self.loss_is_scaled_for_ga is False:
            refusal = (
                "loss_is_scaled_for_ga = False with the model's own loss over num_items_in_batch "
                "(the stock Trainer would divide the normalised loss again): unset it"
            )
        if refusal is not None:
            raise GuardConfigError(f"GuardedTrainer cannot guard this setup: {refusal}")
        cfg = self._guard_config
        global_count = sums and bool(self.args.average_tokens_across_devices) and self.args.world_size > 1
        if cfg.global_item_count and not global_count:
            raise GuardConfigError(
                "guard_config.global_item_count=True but the Trainer does not average tokens across "
                "ranks: set TrainingArguments.average_tokens_across_devices=True instead"
            )
        cfg = dataclasses.replace(
            cfg,
            max_grad_norm=self._max_grad_norm(),
            global_item_count=global_count,
            # A LossSum ignores loss_reduction; "sum" lets the guard's first verification split
            # its probe off the batch too (it cannot know the loss kind before the first pass),
            # so a resumed run's first step matches the uninterrupted run's bit for bit.
            # compute_loss is a mean of unknown weighting (a causal LM's is over tokens, not
            # samples): "unknown" weighs micro-batches by sample share and never splits a probe.
            loss_reduction="sum" if sums else "unknown",
        )
        saved = self._saved_state
        if saved is None:
            if self.state.global_step > 0:
                warnings.warn(
                    f"replicheck: resuming at global step {self.state.global_step} from a checkpoint "
                    f"without the guard's state ({GUARD_STATE_NAME}): the guard starts its schedule "
                    "there, without the newest verified step or tolerant mode's calibration",
                    UserWarning,
                    stacklevel=2,
                )
            cfg = dataclasses.replace(cfg, start_step=self.state.global_step)
        accelerated: Any = self.optimizer
        # Accelerate's AcceleratedOptimizer is itself an Optimizer subclass (without its state):
        # the guard gets the torch optimizer it wraps, and steps that.
        inner = getattr(accelerated, "optimizer", accelerated)
        if getattr(accelerated, "scaler", None) is not None:
            raise GuardConfigError("the Trainer's optimizer steps through a loss scaler: use bf16, not fp16")
        if not isinstance(inner, torch.optim.Optimizer):
            raise GuardConfigError(
                f"the Trainer's optimizer is not a torch optimizer: {type(inner).__name__}"
            )
        guard = Guard(model, inner, self._loss_sum if sums else self._loss_mean, config=cfg)
        if saved is not None:
            guard.load_state_dict(saved)
        self._guard = guard
        self._accelerated = accelerated
        # The proxy delegates every attribute but step() to the Trainer's optimizer.
        self.optimizer = cast(torch.optim.Optimizer, _StepProxy(accelerated, self))
        self.callback_handler.optimizer = self.optimizer
        log.info(
            "replicheck guard built at step %d (%s loss, verify every %d)",
            guard.next_step,
            "token-sum" if sums else cfg.loss_reduction,
            cfg.verify_every,
        )
        return guard

    def _loss_sum(self, module: torch.nn.Module, batch: dict[str, Any]) -> LossSum:
        """The model's loss summed over the micro-batch's label tokens, with their count.

        Hugging Face's losses divide their sum by ``num_items_in_batch`` when given one, so 1
        gives the sum. No collective here: the guard also calls it on single ranks (replays)."""
        one = torch.ones((), device=self.args.device)
        with self.compute_loss_context_manager():
            outputs = module(**batch, num_items_in_batch=one)
        total = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return LossSum(total=total, count=self._item_count(batch))

    def _loss_mean(self, module: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """``compute_loss`` of one micro-batch (a mean over it, weighted by the guard)."""
        with self.compute_loss_context_manager():
            loss = self.compute_loss(module, batch)
        return loss if isinstance(loss, torch.Tensor) else loss[0]

    def _item_count(self, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's label tokens, counted as the Trainer's ``_get_num_items_in_batch``."""
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        elif self._loss_shifts_labels:
            labels = batch["labels"][..., 1:]
        else:
            labels = batch["labels"]
        return labels.ne(_IGNORE_INDEX).sum()

    def _sums_tokens(self, batch: Any) -> bool:
        """Whether the stock Trainer would normalise this job's loss by its label-token count."""
        return (
            bool(self.model_accepts_loss_kwargs)
            and not self._custom_compute_loss()
            and isinstance(batch, dict)
            and "labels" in batch
        )

    def _custom_compute_loss(self) -> bool:
        return type(self).compute_loss is not Trainer.compute_loss

    def _mean_loss_refusal(self, has_labels: bool) -> str | None:
        """Why ``compute_loss`` cannot be the guard's per-micro-batch loss, or ``None``: the stock
        Trainer must count it as a per-micro-batch mean (``loss_is_scaled_for_ga`` false; unset,
        it counts as normalised over the window when it was given ``num_items_in_batch``, which
        it is for a model taking loss kwargs and a batch with labels)."""
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = bool(self.model_accepts_loss_kwargs) and has_labels
        if not scaled:
            return None
        return (
            "a compute_loss the Trainer counts as already normalised over the accumulation window "
            "(it needs num_items_in_batch, which the guard's per-pass calls cannot give): return "
            "a per-micro-batch mean and set loss_is_scaled_for_ga = False"
        )

    def _max_grad_norm(self) -> float | None:
        """``args.max_grad_norm`` as the guard's clipping bound (0, ``None`` or inf: none)."""
        value = self.args.max_grad_norm
        if value is None or not 0 < value < math.inf:
            return None
        return float(value)

    def _note_stepped(self) -> None:
        """The Trainer's ``optimizer.step()`` of this window: the guard must have stepped."""
        if self._result is None:
            raise GuardMisuseError(
                "optimizer.step() without a guarded step in this window: GuardedTrainer steps the "
                "optimizer in training_step (through the guard); do not call optimizer.step() yourself"
            )
        self._result = None


class _StepProxy:
    """Stands in for the Trainer's optimizer once the guard steps it: ``step()`` only checks that
    the guard stepped in this window; everything else is the wrapped optimizer's."""

    def __init__(self, wrapped: Any, trainer: GuardedTrainer) -> None:
        object.__setattr__(self, "_wrapped", wrapped)
        object.__setattr__(self, "_trainer", trainer)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise GuardMisuseError("optimizer.step(closure): the guard owns the step, closures are not run")
        self._trainer._note_stepped()
        # torch's LR scheduler notes an optimizer step this way (it wrapped the Trainer
        # optimizer's step, which the guard bypasses); without it the scheduler warns.
        self._wrapped._opt_called = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)

    def __repr__(self) -> str:
        return f"GuardedStep({self._wrapped!r})"
