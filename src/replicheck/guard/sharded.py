"""FSDP2 (``fully_shard``) and HSDP: where the guard sees each rank's gradient, and the mesh.

No rank of a sharded job holds a whole gradient: each layer's unsharded gradient exists for a
moment on every rank, is copied into one flat buffer and reduce-scattered. The guard takes the
reduce-scatter slot (``FSDPModule.set_custom_reduce_scatter``, public API) so it sees that
buffer, this rank's own contribution, before the reduction: on a training pass it adds the
buffer's squared norm to the rank's local gradient norm (a non-finite or huge gradient is named
on the rank that produced it) and then reduce-scatters as FSDP would; on a probe pass it
fingerprints the buffer and skips the reduction (every rank is in a probe pass at the same time,
so every rank skips it). Nothing is kept but one fingerprint per layer group: no second copy of
any gradient. ``docs/design/sharded.md`` gives the reasoning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the public setter's type
from torch.distributed.tensor import DTensor

from replicheck import fingerprint as fp
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.health import GradStats, sq_norm
from replicheck.guard.probe import Capture
from replicheck.guard.scatter import ScatterCheck, supported


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded with ``fully_shard`` (FSDP2 or HSDP)."""
    return isinstance(model, FSDPModule)


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every ``fully_shard`` unit in ``model`` (the root first), with its name."""
    return [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


@dataclass(frozen=True)
class ShardLayout:
    """Which ranks hold the same shard: the replicate dimension of an HSDP mesh."""

    replicas: int
    """Replica groups (1 for plain FSDP2)."""
    shards: int
    """Ranks a parameter is sharded over inside one replica group."""
    same_shard: tuple[tuple[int, ...], ...]
    """For each shard index, the global ranks holding it (one per replica group)."""

    def groups_of(self, world_size: int) -> list[list[int]]:
        """Ranks whose stored state must be equal: those holding the same shard."""
        return [list(g) for g in self.same_shard if len(g) > 1 and max(g) < world_size]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ShardLayout:
        """The layout of ``model``'s device mesh; refuses parameters that are not on one mesh."""
        meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1:
            raise GuardConfigError(
                "every parameter of a fully_shard model must be sharded on one device mesh "
                f"(found {len(meshes)} meshes); shard the whole model with one mesh"
            )
        mesh = next(iter(meshes.values()))
        ranks = mesh.mesh
        world = dist.get_world_size() if dist.is_initialized() else 1
        if ranks.numel() != world:
            raise GuardConfigError(
                f"the model's device mesh covers {ranks.numel()} of the job's {world} ranks; the guard "
                "needs the mesh to span the job (tensor or pipeline parallel dimensions are not supported)"
            )
        if ranks.dim() == 1:
            return cls(replicas=1, shards=ranks.numel(), same_shard=tuple((int(r),) for r in ranks))
        if ranks.dim() != 2:
            raise GuardConfigError(f"a {ranks.dim()}-D device mesh is not supported (FSDP2: 1-D, HSDP: 2-D)")
        return cls(
            replicas=ranks.shape[0],
            shards=ranks.shape[1],
            same_shard=tuple(tuple(int(r) for r in ranks[:, s]) for s in range(ranks.shape[1])),
        )


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def weights_digest(model: torch.nn.Module, per_rank: Sequence[str] = ()) -> torch.Tensor:
    """:func:`fingerprint.model_digest_tensor` of ``model``'s ``replicated`` state (the same
    tensors: normalisation statistics and ``per_rank`` buffers left out), over this rank's shards."""
    return fp.weights_digest_tensor(
        local(t.detach()) for _, t in fp.named_state(model, "replicated", per_rank=per_rank)
    )


def optimizer_digest(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """:func:`fingerprint.optimizer_digest_tensor` over this rank's shards of the optimizer state."""
    state = {
        i: {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    return fp.optimizer_digest_tensor(state)


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

    def __init__(self, model: torch.nn.Module, *, digest_reduced: bool, check_scatter: bool = False) -> None:
        self._mode: TapMode = "train"
        self.scatter = ScatterCheck() if check_scatter else None
        """Plain FSDP2: every training reduce-scatter checked against the sum of its inputs
        (:mod:`replicheck.guard.scatter`); ``None`` when off or under HSDP (replicas vote)."""
        self.pre_scale = 1.0
        """Factor this rank's gradient is multiplied by before a training reduce-scatter (a
        ``LossSum`` step's division by its item count, after unreduced accumulation)."""
        self._capture: Capture | None = None
        self._captured: list[torch.Tensor] = []
        self.units: list[str] = []
        """The ``fully_shard`` units of the last probe pass, in the order their gradients came
        (what each entry of a sharded fingerprint covers)."""
        super().__init__(digest_reduced)
        for name, unit in fsdp_modules(model):
            unit.set_custom_reduce_scatter(_UnitReduceScatter(self, name))
            unit.set_all_reduce_hook(self._after_reduce)

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
        self._local_sq.append(sq_norm(buffer))
        if self.scatter is not None and supported(op):
            self.scatter.reduce(output, buffer, group, op)  # synchronous, as FSDP2 calls it
            return None
        work: dist.Work | None = dist.reduce_scatter_single(
            output, buffer, op=op, group=group, async_op=async_op
        )
        return work

    def _after_reduce(self, reduced: torch.Tensor) -> None:
        if self._mode == "probe":
            return
        index, self._index = self._index, self._index + 1
        self._run_hooks(index, reduced)
        if self.scatter is not None and self.reduced_hooks:
            # Only hooks run between the collective and here: without any, the shard is the
            # collective's output, already sketched.
            self.scatter.after_hooks(reduced)
        if self.digest_reduced:
            self._reduced[index] = fp.digest(reduced)


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


def collectives_of_forward(model: torch.nn.Module) -> None:
    """Take part in a forward's parameter all-gathers without running it (unit by unit, in the
    order FSDP runs them), for a rank whose loss function failed before it called the model."""
    for _, unit in fsdp_modules(model):
        unit.unshard()
        unit.reshard()
