"""The seam between a guarded step and how the job is parallel.

One :class:`Parallelism` per kind of job (DDP, FSDP2 and HSDP, world size 1...) answers every
question the step would otherwise answer by branching on the model's type: which module replays
run on, where a rank's own gradient is seen before its reduction, how several passes of a step
accumulate, whether a discarded pass runs alone or in lockstep with every rank, which state is
replicated and across which ranks it is compared, which update checks apply, and which device
and process group the guard's own messages use. The step core (:mod:`replicheck.guard.step`)
imports this module and no specific parallelism; the kinds register here (:func:`register`) and
:func:`detect` picks the one that claims a model. Adding a parallelism means one subclass, its
registration in :mod:`replicheck.guard.parallel`, and its tests.

Device discipline: :attr:`Parallelism.device` is the compute device (where the rank's probe
passes, gradients and fingerprints are computed; under FSDP2's CPU offload not where its
parameters are stored); ``comm.device`` is the communication device (where collectives move
tensors), derived from the compute device and the group's backend for its type
(:func:`~replicheck.guard.transport.comm.comm_device`). The two may differ, and every value that
crosses ranks is moved between them explicitly (see ``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from replicheck import fingerprint as fp
from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.transport.comm import Comm, default_compute

if TYPE_CHECKING:
    from replicheck.guard.attribution.ring import Ring
    from replicheck.guard.attribution.verdict import Finding

T = TypeVar("T")

Capture = Callable[[torch.Tensor, int], torch.Tensor]
"""``capture(gradient_buffer, index)``: what a lockstep probe pass keeps of one gradient buffer
(a fingerprint part, or a squared norm), on the device."""

Contexts = Callable[[], AbstractContextManager[None]]
"""Enters the contexts a discarded pass runs under (seed, kernels, buffers): called again for a
retried pass, so the retry starts from the same seed."""

LossRun = Callable[[], object]
"""Runs ``loss_fn`` on a pass's batch: a loss tensor or a ``LossSum``."""


@dataclass(frozen=True)
class DiscardedPass:
    """A pass whose gradient is thrown away (a probe, a replay, a re-run)."""

    run: LossRun
    """Its loss."""
    weight: float
    """The factor its loss is multiplied by before the backward."""
    contexts: Contexts
    """What it runs under."""


class Fingerprints(Protocol):
    """How a pass's gradients become a fingerprint (whole, or a part per gradient buffer)."""

    def __call__(self, grads: Sequence[torch.Tensor | None], seed: int) -> torch.Tensor:
        """The fingerprint of whole gradients."""

    def part(self, seed: int) -> Capture:
        """The fingerprint of one gradient buffer, taken as it is produced."""

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fingerprint made of :meth:`part` results."""


class UpdateCheck(Protocol):
    """A check of each rank's optimizer update, run after the step on verification steps."""

    def arm(self) -> None:
        """Record the next optimizer step."""

    def check(self, step: int) -> Finding | None:
        """Collective: the finding when an update is disputed, else ``None``."""

    def restore(self) -> None:
        """Put back the state this rank had before the recorded step."""


class Replays(ABC):
    """How this rank runs a discarded pass (a probe, a replay, a re-run): gradients are computed
    without touching ``.grad`` and without reducing anything."""

    def begin_step(self, batch: Any, probe_size: int) -> None:
        """A new step starts with ``batch`` as its first micro-batch."""
        return None

    @abstractmethod
    def fingerprint(
        self, p: DiscardedPass, prints: Fingerprints, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's loss and gradient fingerprint (under ``seed``), on the device."""

    @abstractmethod
    def gradient_norm(self, passes: Sequence[DiscardedPass]) -> torch.Tensor | None:
        """The local gradient norm of the passes together, on the device; ``None`` when no
        gradient was produced."""

    def together(self, passes: int, run: Callable[[], T], filler: Callable[[Any], object]) -> T:
        """``run()``, which runs ``passes`` discarded passes on this rank; where a pass is a
        collective, every rank then runs ``filler`` passes up to the most any rank ran."""
        return run()

    def settle(self, filler: Callable[[Any], object]) -> None:
        """After the step's checks, before its update: where ranks that run passes in lockstep
        judge different rows (torchft's columns inside one replica group), take part, with
        ``filler`` passes, in the phases the others are still in, until every one is done."""
        return None


class Parallelism(ABC):
    """One kind of parallel job, and every answer the guard needs about it (module docstring)."""

    kind: ClassVar[str]
    """Short name, for logs and error messages."""
    split_probe: ClassVar[bool] = True
    """Whether a probe may be split off the real batch (its gradient kept apart, unreduced)."""
    passes_are_collective: ClassVar[bool] = False
    """Whether every pass is a collective (parameters gathered in forward): every rank must then
    know after each forward whether any failed, and discarded passes run in lockstep."""
    row_reaches_every_rank: ClassVar[bool] = True
    """Whether the step's row all-gather reaches every rank whose collectives the step's passes
    share (not so inside a torchft replica group, whose rows go over its column): a failure in
    the passes of a step that runs no collective of its own before the row (an ordinary step)
    then rides in the row, with no flag after the passes."""
    reduces_every_pass: ClassVar[bool] = False
    """Whether each backward reduces its gradient (sharded accumulation) instead of accumulating
    locally until the step's last pass; a ``LossSum`` division over several passes then happens in
    the reductions (:meth:`set_reduction_scale`): in each when the step's item count is known
    before its first pass (``GuardConfig.item_count``), else in the last, the earlier passes held
    unreduced (:meth:`hold_reduction`)."""
    rebuilds_on_resume: ClassVar[bool] = False
    """Whether a resumed job runs one synced backward first (DDP settles its bucket layout)."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, comm: Comm) -> None:
        self.model = model
        """What training passes call (the wrapper, when there is one)."""
        self.module = module
        """The bare module: replays run on it, digests read it."""
        self.comm = comm
        """Collectives of the guarded job's process group (the guard's own messages)."""

    # -- what the job is ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The compute device: where this rank's passes run and its gradients are made."""
        return module_device(self.module)

    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters the guard checks."""
        named = fp.named_weights(self.module, "trainable")
        if not named:
            raise GuardConfigError("the model has no trainable parameters")
        return named

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` this rank holds (the whole tensor unless the state is sharded)."""
        return t

    @property
    def replica_groups(self) -> list[list[int]] | None:
        """Ranks whose stored state must be equal; ``None``: every rank holds the same state."""
        return None

    @property
    def replicated(self) -> bool:
        """Whether any two ranks hold the same state to compare."""
        return self.comm.world_size > 1

    # -- gradients ------------------------------------------------------------------------------
    @abstractmethod
    def install(self, config: GuardConfig) -> GradStats:
        """Take the place where this rank's gradient is seen before its reduction; return the
        step's gradient statistics."""

    @abstractmethod
    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        """How discarded passes run (after :meth:`install`)."""

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        """Around a pass (forward and backward): reduce its gradient only when ``sync``."""
        return contextlib.nullcontext()

    def hold_reduction(self, hold: bool) -> AbstractContextManager[Any]:
        """Around a backward that reduces every pass: ``hold`` keeps its gradient unreduced."""
        return contextlib.nullcontext()

    def set_reduction_scale(self, scale: float) -> None:
        """Multiply this rank's gradient by ``scale`` in the next reductions (1.0: none)."""
        return None

    def sync_off(self) -> str | None:
        """What the job's own code left switched off that a guarded step needs on (gradient sync,
        as DDP's ``no_sync()`` leaves it), in words; ``None`` when nothing is."""
        return None

    def forwards(self) -> int:
        """Forwards of the model entered so far (a failed loss function may never call it);
        0 where no forward runs a collective."""
        return 0

    def join_failed_forward(self, skipped: bool) -> None:
        """This rank's forward failed before it called the model: take part in the collectives
        the model runs in a forward, as the other ranks do. ``skipped``: the pass was not even
        started (an earlier failure in the step)."""
        return None

    def failing_backward(self, synced: bool) -> AbstractContextManager[Any]:
        """Around a backward: when it raises on this rank, finish what the other ranks wait for."""
        return contextlib.nullcontext()

    def join_failed_backward(self) -> None:
        """This rank failed before the step's synchronising backward (passes that are not
        collectives): take part in the reductions the other ranks' backward runs."""
        return None

    def fingerprint_names(self) -> tuple[str, ...] | None:
        """What each entry of a probe fingerprint covers, when not one per checked parameter."""
        return None

    # -- state ------------------------------------------------------------------------------------
    def weights_digest(self, per_rank: Sequence[str]) -> torch.Tensor:
        """Every parameter and every shared buffer this rank holds, as a device digest."""
        return fp.model_digest_tensor(self.module, "replicated", per_rank=per_rank)

    def optimizer_digest(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The optimizer state this rank holds, as a device digest."""
        return fp.optimizer_digest_tensor(optimizer)

    def update_check(
        self, optimizer: torch.optim.Optimizer, ring: Ring, config: GuardConfig
    ) -> UpdateCheck | None:
        """The check of each rank's optimizer update where no replica holds the same state."""
        return None


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: the device of its first parameter (its local part, when
    sharded), else of its first buffer, else the current accelerator or the host."""
    for t in (*module.parameters(), *module.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        return torch.device(local.device)
    return default_compute()


Claim = Callable[[torch.nn.Module], "Parallelism | None"]
"""Returns a parallelism for a model of its kind, else ``None``."""

_KINDS: list[Claim] = []


def register(claim: Claim) -> Claim:
    """Add a kind to :func:`detect` (in order: the first that claims a model wins)."""
    _KINDS.append(claim)
    return claim


def detect(model: torch.nn.Module) -> Parallelism:
    """The registered parallelism that claims ``model``."""
    for claim in _KINDS:
        found = claim(model)
        if found is not None:
            return found
    raise GuardConfigError(
        "with world size > 1 the model must be wrapped in DistributedDataParallel or sharded "
        "with fully_shard (FSDP2, HSDP)"
    )


class ForwardCounter:
    """Counts the forwards a module enters (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._entered)

    def _entered(self, module: torch.nn.Module, args: object) -> None:
        self.count += 1


@contextlib.contextmanager
def grads_put_back(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Every ``.grad`` set aside for the block and put back as it was afterwards."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g
