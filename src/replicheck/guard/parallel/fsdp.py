"""FSDP2 (``fully_shard``) and HSDP: a sharded model, its mesh and what the guard compares.

Plain FSDP2 (a 1-D mesh) holds each shard of the weights and optimizer state on one rank only,
so nothing is compared across replicas; the reduce-scatter check and the update replay check
the computations that produce that state instead. HSDP (a 2-D replicate × shard mesh) holds each
shard once per replica group: those copies are compared as DDP's replicas are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from replicheck.guard import shards
from replicheck.guard.checks.health import GradStats
from replicheck.guard.checks.update import REPLAYABLE, UpdateReplay, replayable
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.base import ForwardCounter, Parallelism, Replays
from replicheck.guard.parallel.fsdp_tap import (
    ForwardOrder,
    GradTap,
    collectives_of_forward,
    gradient_sync,
    refuse_untappable,
)
from replicheck.guard.parallel.lockstep import LockstepReplays
from replicheck.guard.transport.comm import Comm

if TYPE_CHECKING:
    from replicheck.guard.attribution.ring import Ring

log = logging.getLogger(__name__)


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
        """The layout of ``model``'s device mesh; refuses parameters that are not on one mesh
        and replicated training through FSDP2 (no rank's reduce-scatter would run)."""
        # Equal meshes are one mesh: fully_shard called per unit without a mesh makes its own.
        meshes: dict[tuple[object, ...], DeviceMesh] = {}
        shard_dims: set[tuple[int, ...]] = set()
        for p in model.parameters():
            if isinstance(p, DTensor):
                meshes.setdefault(_mesh_key(p.device_mesh), p.device_mesh)
                shard_dims.add(tuple(d for d, pl in enumerate(p.placements) if pl.is_shard()))
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
        if ranks.dim() > 2:
            raise GuardConfigError(f"a {ranks.dim()}-D device mesh is not supported (FSDP2: 1-D, HSDP: 2-D)")
        sharded_over = max((math.prod(ranks.shape[d] for d in dims) for dims in shard_dims), default=1)
        if world > 1 and sharded_over == 1:
            # FSDP2 skips a reduce-scatter over one rank: the guard would see no rank's gradient.
            raise GuardConfigError(
                "the model's parameters are replicated, not sharded (torch's FSDP2-based replicate(), "
                f"or an HSDP mesh of shape {tuple(ranks.shape)} whose shard dimension has one rank): "
                "FSDP2 then runs no reduce-scatter, where the guard sees each rank's gradient. Wrap "
                "the model in DistributedDataParallel for replicated training, or shard over 2 or "
                "more ranks per replica group"
            )
        if ranks.dim() == 1:
            return cls(replicas=1, shards=ranks.numel(), same_shard=tuple((int(r),) for r in ranks))
        return cls(
            replicas=ranks.shape[0],
            shards=ranks.shape[1],
            same_shard=tuple(tuple(int(r) for r in ranks[:, s]) for s in range(ranks.shape[1])),
        )


def _mesh_key(mesh: DeviceMesh) -> tuple[object, ...]:
    """What a device mesh is: its device type, its ranks in their layout, its dimension names."""
    return (
        mesh.device_type,
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh.flatten().tolist()),
        mesh.mesh_dim_names,
    )


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device FSDP2 computes ``model`` on: its parameter groups' device (what FSDP
    all-gathers into, also under ``CPUOffloadPolicy``), else its mesh's device type with that
    type's current index, as ``fully_shard`` chooses it."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", ()):
                device = getattr(group, "device", None)
                if isinstance(device, torch.device):
                    return device
    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


class Sharded(Parallelism):
    """A model sharded with ``fully_shard``: plain FSDP2 on a 1-D mesh, HSDP on a 2-D one."""

    kind = "fsdp2"
    split_probe = False  # a split probe would need FSDP to keep whole gradients unreduced
    passes_are_collective = True
    reduces_every_pass = True

    def __init__(self, model: torch.nn.Module) -> None:
        refuse_untappable(model)
        self.layout = ShardLayout.of(model)
        self._device = compute_device(model)
        super().__init__(model, model, Comm(None, compute=self._device))
        self._tap: GradTap | None = None
        self._forwards = ForwardCounter(model)
        self._order = ForwardOrder(model)

    @classmethod
    def claim(cls, model: torch.nn.Module) -> Sharded | None:
        return cls(model) if isinstance(model, FSDPModule) else None

    @property
    def device(self) -> torch.device:
        """FSDP's compute device (under ``CPUOffloadPolicy`` the parameters are stored on the
        host but every forward and backward runs here)."""
        return self._device

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return shards.local(t)

    @property
    def replica_groups(self) -> list[list[int]] | None:
        return self.layout.groups_of(self.comm.world_size)

    @property
    def replicated(self) -> bool:
        return self.comm.world_size > 1 and self.layout.replicas > 1

    @property
    def tap(self) -> GradTap:
        if self._tap is None:
            raise GuardConfigError("internal: the sharded model's gradients are not tapped yet")
        return self._tap

    def install(self, config: GuardConfig) -> GradStats:
        # Replica groups vote on the reduced shards; plain FSDP2 checks each reduce-scatter instead.
        self._tap = GradTap(
            self.model,
            digest_reduced=config.check_reduced and self.layout.replicas > 1,
            check_scatter=config.check_reduced and self.layout.replicas == 1 and self.comm.world_size > 1,
            alone=self.comm.world_size == 1,
        )
        return self._tap

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return LockstepReplays(self.comm, self.tap, self._forwards, self._order, params)

    def hold_reduction(self, hold: bool) -> AbstractContextManager[Any]:
        return gradient_sync(self.model, not hold)

    def set_reduction_scale(self, scale: float) -> None:
        self.tap.pre_scale = scale

    def sync_off(self) -> str | None:
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
                if group is not None and getattr(group, "reduce_grads", True) is False:
                    return "FSDP2's gradient sync is off (set_requires_gradient_sync(False))"
        return None

    def forwards(self) -> int:
        return self._forwards.count

    def join_failed_forward(self, skipped: bool) -> None:
        if not skipped:
            collectives_of_forward(self._order)

    def fingerprint_names(self) -> tuple[str, ...] | None:
        # One fingerprint entry per layer group, in the order backward made them.
        return tuple(self.tap.units) if self.tap.units else None

    def weights_digest(self, per_rank: Sequence[str]) -> torch.Tensor:
        return shards.weights_digest(self.module, per_rank)

    def optimizer_digest(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return shards.optimizer_digest(optimizer)

    def update_check(
        self, optimizer: torch.optim.Optimizer, ring: Ring, config: GuardConfig
    ) -> UpdateReplay | None:
        """Plain FSDP2: the ring's replay of each rank's optimizer update (no replica holds it)."""
        if self.layout.replicas > 1 or self.comm.world_size < 2 or not config.replay_update:
            return None
        if not replayable(optimizer):
            log.warning(
                "plain FSDP2 with %s: its update cannot be replayed shard by shard, so a corrupted "
                "optimizer update goes undetected (use HSDP with 3+ replica groups, or one of the "
                "elementwise torch optimizers: %s)",
                type(optimizer).__name__,
                ", ".join(c.__name__ for c in REPLAYABLE),
            )
            return None
        return UpdateReplay(optimizer, self.comm, ring)
