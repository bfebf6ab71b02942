"""FSDP2's reduce-scatter slot: where the guard sees each rank's gradient of a sharded model.

No rank of a sharded job holds a whole gradient: each layer's unsharded gradient exists for a
moment on every rank, is copied into one flat buffer and reduce-scattered. The guard takes the
reduce-scatter slot (``FSDPModule.set_custom_reduce_scatter``, public API) so it sees that
buffer, this rank's own contribution, before the reduction: on a training pass it adds the
buffer's squared norm to the rank's local gradient norm (a non-finite or huge gradient is named
on the rank that produced it) and then reduce-scatters as FSDP would; on a probe pass it
fingerprints the buffer and skips the reduction (every rank is in a probe pass at the same time,
so every rank skips it). Nothing is kept but one fingerprint per layer group: no second copy of
any gradient. ``docs/sharded.md`` gives the reasoning.

At world size 1 FSDP2 calls no reduce-scatter (it copies the buffer into the shard): the same
view is taken in the hook FSDP runs after every reduction, where the shard is then this rank's
own gradient.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the public setter's type
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from replicheck import fingerprint as fp
from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks import scatter
from replicheck.guard.checks.health import GradStats, sq_norm
from replicheck.guard.checks.scatter import ScatterCheck, supported
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.base import Capture


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every ``fully_shard`` unit in ``model`` (the root first), with its name."""
    return [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def refuse_untappable(model: torch.nn.Module) -> None:
    """Refuses units whose reduce-scatter slot the guard cannot take over unnoticed: a unit with
    several parameter groups (per-parameter meshes from ``shard_placement_fn``), where FSDP has
    no single slot, and a unit whose slot holds the user's own reduce-scatter, which taking the
    slot would drop. Read from FSDP2's unit state (no public getter exists)."""
    for name, unit in fsdp_modules(model):
        groups = list(getattr(unit._get_fsdp_state(), "_fsdp_param_groups", None) or [])
        if len(groups) > 1:
            raise GuardConfigError(
                f"fully_shard unit {name!r} has {len(groups)} parameter groups (per-parameter meshes "
                "from shard_placement_fn): the guard reads each rank's gradient in the unit's one "
                "reduce-scatter; shard every parameter of a unit on the same mesh"
            )
        for group in groups:
            comm = getattr(group, "_reduce_scatter_comm", None)
            if comm is not None and type(comm) not in (DefaultReduceScatter, _UnitReduceScatter):
                raise GuardConfigError(
                    f"fully_shard unit {name!r} has a custom reduce-scatter ({type(comm).__name__}, "
                    "set with set_custom_reduce_scatter or set_symm_mem_for_comm): the guard takes "
                    "that slot to see each rank's gradient before its reduction and would drop "
                    "yours; construct the Guard on a model without it"
                )


class _UnitReduceScatter(ReduceScatter):
    """The reduce-scatter of one ``fully_shard`` unit, routed through the shared :class:`GradTap`."""

    def __init__(self, tap: GradTap, name: str) -> None:
        self._tap, self._name = tap, name

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self._tap.reduce_scatter(self._name, output_tensor, input_tensor, group, op, async_op)


TapMode = Literal["train", "probe"]


class GradTap(GradStats):
    """The guard's view of a sharded model's gradients, one step at a time.

    The same per-step statistics the guard reads from DDP's comm hook: the local norm is summed
    over every reduce-scatter input of the step's training passes, the reduced digest (HSDP only,
    where replica groups hold the same reduced shard) over every reduced shard.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        digest_reduced: bool,
        check_scatter: bool = False,
        alone: bool = False,
        across: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._mode: TapMode = "train"
        self._across = across
        """The reduction across replica groups that FSDP itself does not run (torchft's groups):
        applied in place to each reduced shard of a training pass, before the reduced-gradient
        hooks and digest."""
        self._alone = alone
        """World size 1: no reduce-scatter runs; the hook after each reduction sees the gradient."""
        self.scatter = ScatterCheck() if check_scatter else None
        """Plain FSDP2: every training reduce-scatter checked against the sum of its inputs
        (:mod:`replicheck.guard.checks.scatter`); ``None`` when off or under HSDP (replicas vote)."""
        self.pre_scale = 1.0
        """Factor this rank's gradient is multiplied by before a training reduce-scatter (a
        ``LossSum`` step's division by its item count: on every pass when it is known before the
        first, else on the last pass, after unreduced accumulation)."""
        self._capture: Capture | None = None
        self._captured: list[torch.Tensor] = []
        self.units: list[str] = []
        """The ``fully_shard`` units of the last probe pass, in the order their gradients came
        (what each entry of a sharded fingerprint covers)."""
        super().__init__(digest_reduced)
        for name, unit in fsdp_modules(model):
            unit.set_custom_reduce_scatter(_UnitReduceScatter(self, name))
            unit.set_all_reduce_hook(functools.partial(self._after_reduce, name))

    def reset(self) -> None:
        """Start a step."""
        super().reset()
        self._index = 0
        if self.scatter is not None:
            self.scatter.reset()

    def reduced_digest(self) -> torch.Tensor | int:
        """HSDP: the reduced shards' digest; plain FSDP2 with the scatter check: its verdict."""
        if self.scatter is not None:
            return self.scatter.status()
        return super().reduced_digest()

    def reduced_finding(
        self, values: Sequence[int], groups: Sequence[Sequence[int]] | None
    ) -> Finding | None:
        """Plain FSDP2 with the scatter check: every rank's verdict; else the replica vote."""
        if self.scatter is not None:
            return scatter.finding([int(v) for v in values])
        return super().reduced_finding(values, groups)

    @contextlib.contextmanager
    def capturing(self, capture: Capture) -> Iterator[list[torch.Tensor]]:
        """A probe pass: each reduce-scatter input goes to ``capture`` and is not reduced."""
        if self._mode != "train":
            raise RuntimeError("internal: nested probe capture")
        self._mode, self._capture, self._captured = "probe", capture, []
        self.units = []
        try:
            yield self._captured
        finally:
            self._mode, self._capture = "train", None

    # -- FSDP's calls --------------------------------------------------------------------------
    def reduce_scatter(
        self,
        unit: str,
        output: torch.Tensor,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool,
    ) -> dist.Work | None:
        if self._mode == "probe" and self._capture is not None:
            self._captured.append(self._capture(buffer, len(self._captured)))
            self.units.append(unit)
            # Every rank is in the same probe pass: none reduces, and the discarded gradient is 0.
            output.zero_()
            return None
        if self.pre_scale != 1.0:
            buffer.mul_(self.pre_scale)
        if self.scatter is not None and supported(op):
            # Synchronous, as FSDP2 calls it; the input's sketch gives the local norm (one read).
            self._local_sq.append(self.scatter.reduce(output, buffer, group, op))
            return None
        self._local_sq.append(sq_norm(buffer))
        work: dist.Work | None = dist.reduce_scatter_single(
            output, buffer, op=op, group=group, async_op=async_op
        )
        return work

    def _after_reduce(self, unit: str, reduced: torch.Tensor) -> None:
        if self._alone:
            # No reduce-scatter ran: ``reduced`` is the buffer's copy, this rank's own gradient.
            if self._mode == "probe" and self._capture is not None:
                self._captured.append(self._capture(reduced, len(self._captured)))
                self.units.append(unit)
                return
            if self.pre_scale != 1.0:
                reduced.mul_(self.pre_scale)
            self._local_sq.append(sq_norm(reduced))
        if self._mode == "probe":
            return
        if self._across is not None:
            self._across(reduced)
        index, self._index = self._index, self._index + 1
        self._run_hooks(index, reduced)
        if self.scatter is not None and self.reduced_hooks:
            # Only hooks run between the collective and here: without any, the shard is the
            # collective's output, already sketched.
            self.scatter.after_hooks(reduced)
        if self.digest_reduced:
            self._reduced[index] = fp.row_digest(reduced)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """A backward that reduces gradients (``sync``), or accumulates them unreduced on this rank
    (FSDP2's ``set_requires_gradient_sync(False)``); nothing to do for another model."""
    if sync or not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class ForwardOrder:
    """The ``fully_shard`` units in the order the model's last complete forward entered them
    (each entry an all-gather), recorded by forward hooks: what a rank that skips a forward
    replays. Units entered outside the root's forward (recomputation in a backward) are not
    recorded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._units = fsdp_modules(model)
        self.order: list[FSDPModule] | None = None
        """The last complete forward's units; ``None`` before the first."""
        self._current: list[FSDPModule] | None = None
        model.register_forward_pre_hook(self._root_entered)
        model.register_forward_hook(self._root_left)
        for _, unit in self._units:
            module = cast(torch.nn.Module, unit)  # a fully_shard unit is the module itself
            if module is not model:
                module.register_forward_pre_hook(self._entered(unit))

    def _root_entered(self, module: torch.nn.Module, args: object) -> None:
        self._current = [module] if isinstance(module, FSDPModule) else []

    def _root_left(self, module: torch.nn.Module, args: object, out: object) -> None:
        if self._current is not None:
            self.order, self._current = self._current, None

    def _entered(self, unit: FSDPModule) -> Callable[[torch.nn.Module, object], None]:
        def hook(module: torch.nn.Module, args: object) -> None:
            if self._current is not None:
                self._current.append(unit)

        return hook

    def units(self) -> list[FSDPModule]:
        """The units to replay: the recorded order, else (no forward yet) the modules' order."""
        return list(self.order) if self.order is not None else [u for _, u in self._units]


def collectives_of_forward(order: ForwardOrder) -> None:
    """Take part in a forward's parameter all-gathers without running it (unit by unit, in the
    order the forward ran them), for a rank whose loss function failed before it called the model."""
    for unit in order.units():
        unit.unshard()
        unit.reshard()
