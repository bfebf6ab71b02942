"""Configuration of the guard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from replicheck.guard.errors import GuardConfigError
from replicheck.guard.loss import LossReduction

Mode = Literal["exact", "tolerant"]
"""How probe results are compared: bit for bit, or within a calibrated threshold."""
ProbeMode = Literal["auto", "split", "extra"]
"""Whether a probe is part of the real batch (``split``) or computed in addition (``extra``)."""
ProbeAttention = Literal["math", "default"]
"""Which scaled-dot-product attention backends a deterministic probe pass may use."""
PrecisionChoice = Literal["auto", "fp32", "fp16", "bf16"]
"""What a tolerant-mode job computes in (``auto``: learnt from its first forward)."""


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """How often and how strictly :class:`~replicheck.Guard` checks a training step."""

    verify_every: int = 10
    """Run the ring replay on steps ``s`` with ``s % verify_every == 0``."""
    weights_every: int = 10
    """Compare weights and optimizer state across replicas every this many steps (0: never)."""
    mode: Mode = "exact"
    """``exact``: bit-for-bit digests, deterministic kernels for probe passes.
    ``tolerant``: norm-scaled sketches with a threshold calibrated from the job's own noise."""
    probe_size: int = 1
    """Samples taken from the front of the first micro-batch as the probe."""
    probe: ProbeMode = "auto"
    """``split``: the probe is part of the real batch (no extra compute for the source).
    ``extra``: the probe is computed in addition (needed for BatchNorm in train mode).
    ``auto``: ``extra`` when the model has a BatchNorm layer in train mode or its training forward
    draws random numbers (dropout, ``F.dropout``, attention dropout: seen from the generators'
    state changing during a forward, not from a list of module types), else ``split``: a split
    probe runs seeded, so its samples would not get the dropout masks the plain loop draws.
    A split is used only where it is exact: ``loss_fn`` returns a :class:`~replicheck.guard.LossSum`,
    or ``loss_reduction`` declares what its plain loss is; otherwise the probe is ``extra``
    (with a warning when ``split`` was asked for)."""
    loss_reduction: LossReduction = "unknown"
    """What a plain scalar loss from ``loss_fn`` is over its batch: ``sample_mean`` (mean of
    per-sample losses, so passes are weighted by sample count), ``sum`` (every pass weighs 1),
    or ``unknown`` (never split). Ignored when ``loss_fn`` returns a ``LossSum``."""
    item_count: Callable[[Any], float] | None = None
    """``item_count(micro_batch)``: the item count the micro-batch's ``LossSum`` will report,
    from the batch alone (e.g. its non-padding labels), or ``None``. With FSDP2 and a ``LossSum``
    over several micro-batches, the rank's normaliser (1 / its step's items) is then known before
    the first backward, so each micro-batch is reduce-scattered as it ends; without it the
    division waits for the last forward, and every rank holds the whole model's unsharded
    gradient until the last backward (FSDP's memory saving lost for the step). A pass whose
    ``LossSum.count`` differs from it raises ``LossContractError``."""
    global_item_count: bool = False
    """With a ``LossSum``: normalise by the item count summed over every rank (one all-reduce of
    the count per step), not by this rank's own. The step then trains on the global mean
    ``sum(total) / sum(count)`` over every pass of every rank, as Hugging Face's
    ``average_tokens_across_devices=True`` does (each rank's loss ``total · world_size / global
    count``, which the gradient reduction's mean over ranks brings back to the global mean)."""
    max_grad_norm: float | None = None
    """Clip the reduced gradient as ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)``
    does (the DTensor-aware total norm under FSDP2 and HSDP), after the step's checks, after the
    loss scaler's ``unscale_`` and the gradient edits (:meth:`Guard.add_gradient_edit`), before
    the optimizer step (and its pre-hooks); ``None``: off. ``StepResult.grad_norm`` is then the
    total norm before clipping (one pass over the gradients and one host read per step, so it is
    computed only when clipping is on)."""
    start_step: int = 0
    """Index of the first step this guard runs (a resumed job passes ``checkpoint step + 1``)."""
    resume_verified_step: int | None = None
    """When resuming: the newest passing verification step of the run being continued (from the
    checkpoint's manifest), so an incident before this run's first verification still says it."""
    incident_dir: str | None = None
    """Directory the incident JSON is written to (by one healthy rank), or ``None``."""
    incident_mode: int = 0o640
    """Permission bits of the incident file: by default the group may read it (a controller
    running as another user of the job's group); 0o600 keeps it to the job's user."""
    job_id: str | None = None
    """Job id for incidents; ``None`` reads it from the environment (Slurm job id, or "local")."""
    seed: int = 0
    """Base of the (step, rank) seeds used for probe passes and sketch projections."""
    deterministic: bool | None = None
    """Deterministic kernels for probe and replay passes; ``None``: on in exact mode only."""
    probe_attention: ProbeAttention = "math"
    """Scaled-dot-product attention in deterministic probe passes. ``math``: pinned to the math
    backend (bitwise reproducible everywhere, but it materialises the attention matrix: memory
    grows with the square of the sequence length); the default until a GPU run shows the flash and
    memory-efficient backward bitwise reproducible. ``default``: torch chooses the backend as in
    training, with deterministic algorithms on (flash / memory-efficient attention on a GPU).
    Training passes are never affected."""
    grad_norm_bound: float | None = 1e9
    """Alarm when one rank's local gradient norm (per DDP bucket) exceeds this; ``None``: off.
    Non-finite gradients always alarm."""
    check_reduced: bool = True
    """Every step, check that the all-reduced gradient is bit-identical on every rank (DDP; under
    HSDP every reduced shard across replica groups). Plain FSDP2: check every reduce-scatter's
    output against the sum of its inputs, by linear sketches (:mod:`replicheck.guard.checks.scatter`)."""
    replay_update: bool = True
    """Plain FSDP2, on verification steps: the ring verifier replays each rank's optimizer update
    of its shard (:mod:`replicheck.guard.checks.update`; elementwise torch optimizers only). Costs a copy
    of the shard's parameters, gradients and optimizer state, and its transfer, per verification."""
    sketch_k: int = 4
    """Tolerant mode: random ±1 projections per block, besides its norm."""
    sketch_block: int | None = None
    """Tolerant mode: values per block of a gradient's sketch (each block is compared against its
    own norm, so a sparse fault is not diluted by the whole tensor). The fingerprint holds
    ``sketch_k + 3`` float64 values per block. ``None``: chosen by ``precision`` from the measured
    noise tables (4096 for fp32, 256 for fp16 and bf16; :mod:`replicheck.guard.tolerance`)."""
    tolerance_floor: float | None = None
    """Tolerant mode: lowest relative threshold (difference / block norm) that may alarm: the
    smallest change tolerant mode can catch. ``None``: chosen by ``precision`` (1e-4 fp32, 0.02
    fp16, 0.08 bf16), a safety factor over the largest noise measured for it; a value below that
    noise is accepted with a warning."""
    tolerance_ceiling: float | None = None
    """Tolerant mode: highest threshold calibration may reach (so noise cannot blind it).
    ``None``: chosen by ``precision`` (1e-2 fp32, 0.1 fp16, 0.2 bf16); a value below the measured
    noise is accepted with a warning."""
    precision: PrecisionChoice = "auto"
    """Tolerant mode: what the job computes in, which chooses the tolerances left ``None``.
    ``auto``: learnt from the first forward (the autocast dtype there, else the parameters' dtype,
    else the output's); set it when autocast is entered inside the model's own code."""
    tolerance_margin: float = 10.0
    """Tolerant mode: threshold = margin × the noise calibration measured (between the floor and
    the ceiling)."""
    calibration_verifications: int = 3
    """Tolerant mode: the first verification steps, on which every rank also replays its own probe
    twice (same-device noise) and the ring's pairs give the cross-rank noise (a rank's quieter
    pair, the lower median over ranks: a fault present from step 0 cannot raise it)."""
    per_rank_buffers: tuple[str, ...] = ()
    """Buffers (names as in ``named_buffers()`` of the bare module) that each rank updates from its
    own data in forward, left out of the cross-replica weights comparison. Every other buffer and
    every parameter (frozen ones included) is compared; running statistics of normalisation layers
    are always left out."""
    rebuild_buckets_on_resume: bool = True
    """When ``start_step > 0``: run one synced backward (gradients discarded) before the first
    step, so DDP's rebuilt bucket layout, and therefore the all-reduce order, matches an
    uninterrupted run and a resume is bit-exact."""

    def __post_init__(self) -> None:
        if self.verify_every < 1:
            raise GuardConfigError(f"verify_every must be >= 1, got {self.verify_every}")
        if not isinstance(self.incident_mode, int) or not 0 <= self.incident_mode <= 0o777:
            raise GuardConfigError(
                f"incident_mode must be permission bits 0..0o777, got {self.incident_mode!r}"
            )
        if self.weights_every < 0:
            raise GuardConfigError(f"weights_every must be >= 0, got {self.weights_every}")
        if self.mode not in ("exact", "tolerant"):
            raise GuardConfigError(f"mode must be 'exact' or 'tolerant', got {self.mode!r}")
        if self.probe not in ("auto", "split", "extra"):
            raise GuardConfigError(f"probe must be 'auto', 'split' or 'extra', got {self.probe!r}")
        if self.probe_attention not in ("math", "default"):
            raise GuardConfigError(
                f"probe_attention must be 'math' or 'default', got {self.probe_attention!r}"
            )
        if self.loss_reduction not in ("unknown", "sample_mean", "sum"):
            raise GuardConfigError(
                f"loss_reduction must be 'unknown', 'sample_mean' or 'sum', got {self.loss_reduction!r}"
            )
        if self.item_count is not None and not callable(self.item_count):
            raise GuardConfigError("item_count must be a callable of a micro-batch, or None")
        if self.probe_size < 1:
            raise GuardConfigError(f"probe_size must be >= 1, got {self.probe_size}")
        if self.start_step < 0:
            raise GuardConfigError(f"start_step must be >= 0, got {self.start_step}")
        if self.sketch_k < 1:
            raise GuardConfigError(f"sketch_k must be >= 1, got {self.sketch_k}")
        if self.sketch_block is not None and (
            not isinstance(self.sketch_block, int)
            or isinstance(self.sketch_block, bool)
            or self.sketch_block < 1
        ):
            raise GuardConfigError(f"sketch_block must be an int >= 1 or None, got {self.sketch_block!r}")
        for name in ("tolerance_floor", "tolerance_ceiling"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise GuardConfigError(f"{name} must be a positive number or None, got {value!r}")
        if (
            self.tolerance_floor is not None
            and self.tolerance_ceiling is not None
            and self.tolerance_floor > self.tolerance_ceiling
        ):
            raise GuardConfigError(
                f"need tolerance_floor <= tolerance_ceiling, got {self.tolerance_floor} > {self.tolerance_ceiling}"
            )
        if self.precision not in ("auto", "fp32", "fp16", "bf16"):
            raise GuardConfigError(
                f"precision must be 'auto', 'fp32', 'fp16' or 'bf16', got {self.precision!r}"
            )
        if self.tolerance_margin < 1:
            raise GuardConfigError(f"tolerance_margin must be >= 1, got {self.tolerance_margin}")
        if self.grad_norm_bound is not None and not self.grad_norm_bound > 0:
            raise GuardConfigError("grad_norm_bound must be positive or None")
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float))
            and not isinstance(self.max_grad_norm, bool)
            and 0 < self.max_grad_norm < float("inf")
        ):
            raise GuardConfigError(
                f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm!r}"
            )
        if not isinstance(self.global_item_count, bool):
            raise GuardConfigError(f"global_item_count must be a bool, got {self.global_item_count!r}")
        if self.calibration_verifications < 0:
            raise GuardConfigError("calibration_verifications must be >= 0")

    @property
    def use_deterministic(self) -> bool:
        return self.mode == "exact" if self.deterministic is None else self.deterministic
