"""torchft replica groups (issue 28, first slice): one rank per replica group, the groups kept
equal by torchft's per-step quorum and ``Manager.allreduce``; see ``docs/no-restart.md``.

Inside a group there is one process, so every message of the guard crosses groups: the step's
rows, the ring exchange and the replica comparisons travel over torchft's reconfigurable process
group (the ``pg`` given to the ``Manager``), whose rank and size are the quorum's
(``Manager.participating_rank()``, ``Manager.num_participants()``) and change when the quorum does.

The gradient hook sits where ``torchft.DistributedDataParallel`` puts its own: in the comm-hook
slot of a torch ``DistributedDataParallel`` built as torchft builds it (a dummy process group that
absorbs DDP's own collectives, ``find_unused_parameters=True`` so the buckets never rebuild). The
hook sees each bucket of this group's gradient first (the guard's local checks), then averages it
over the quorum through ``Manager.allreduce``.

Not in this slice, refused at construction (:class:`~replicheck.guard.errors.GuardConfigError`):
more than one rank per group (DDP or FSDP2 inside a group), an FSDP2 module, torchft's async
quorum, tolerant mode, ``global_item_count``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import Parallelism, Replays, module_device
from replicheck.guard.parallel.torchft_hook import TorchftGradHealth, comm_hook
from replicheck.guard.transport.comm import Comm


class TorchftComm(Comm):
    """The guard's collectives over torchft's reconfigurable process group.

    torchft's groups are not in torch.distributed's registry (its ``register()`` gives c10d a
    size-1 stand-in), so the collectives are called on the group object itself, and rank and size
    come from the manager after each quorum (:meth:`refresh`). gloo only in this slice: every
    message is built and moved on the host.
    """

    def __init__(self, manager: Any, pg: Any) -> None:
        # Not Comm.__init__: it asks torch.distributed about a group torch.distributed does not know.
        self.distributed = True
        self.group = pg
        self._pg: Any = pg  # torchft's ProcessGroup (a c10d ProcessGroup subclass, untyped here)
        self.manager = manager
        self.device = torch.device("cpu")
        """Where collectives move tensors: the host (gloo)."""
        self._p2p_ready = True  # gloo needs no first collective before point-to-point messages
        # Until the first quorum (refresh() after Manager.start_quorum): no peer yet.
        self.rank = 0
        self.world_size = 1

    def refresh(self) -> tuple[int, int]:
        """Take rank and size from the manager's current quorum; returns them."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise GuardConfigError(
                "this replica group is not participating in torchft's quorum (a spare, or "
                "healing under the async quorum): the guard runs only in participating groups"
            )
        self.rank, self.world_size = int(rank), int(self.manager.num_participants())
        return self.rank, self.world_size

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        self._pg.allreduce([t], opts).wait()

    def _all_gather_into(self, out: torch.Tensor, local: torch.Tensor) -> None:
        # Views of ``out``: gloo copies each rank's part into them.
        parts = list(out.chunk(self.world_size))
        self._pg.allgather([parts], [local], AllgatherOptions()).wait()

    def _grouped(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        # gloo's send does not wait for its receiver, so posting every op before waiting on any
        # cannot deadlock whatever the pattern; one message per pair and direction, so tag 0.
        works = [self._pg.send([t], dst, 0) for dst, t in sends]
        works += [self._pg.recv([t], src, 0) for src, t in recvs]
        for work in works:
            work.wait()
        self._keep(*(t for _, t in sends), *(t for _, t in recvs))


class TorchftReplicas(Parallelism):
    """One rank per torchft replica group; the guard's comparisons and ring span the groups in the
    quorum (module docstring). Pass it as ``Guard(replicas.model, ..., parallelism=replicas)``, or
    let :class:`replicheck.integrations.torchft.TorchftGuard` build it.

    Taken explicitly rather than claimed from a ``torchft.DistributedDataParallel``: that wrapper
    has already taken DDP's comm-hook slot for its own averaging (a slot DDP fills once), and the
    manager and its process group, which the guard needs, cannot be read back from it.
    """

    kind = "torchft"

    def __init__(self, manager: Any, pg: Any, module: torch.nn.Module) -> None:
        _refuse(manager, pg, module)
        from torchft.process_group import ProcessGroupDummy

        # As torchft builds its DDP: the dummy group absorbs DDP's start-up broadcast and the
        # used-parameters all-reduce; find_unused_parameters keeps the bucket layout fixed.
        ddp = DistributedDataParallel(
            module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True
        )
        comm = TorchftComm(manager, pg)
        super().__init__(ddp, module, comm)
        self.quorum_comm = comm
        """The same object as :attr:`comm`, typed: the torchft collectives (refreshed per quorum)."""
        self.ddp = ddp
        self.manager = manager
        self.health: TorchftGradHealth | None = None
        """The newest guard's gradient view, which the comm hook feeds."""
        self._compute = module_device(module)
        ddp.register_comm_hook(self, comm_hook)

    @property
    def device(self) -> torch.device:
        return self._compute

    def install(self, config: GuardConfig) -> GradStats:
        """A fresh gradient view for a guard (one is built again on each quorum change); the comm
        hook, registered once, feeds the newest."""
        if config.mode != "exact":
            raise GuardConfigError(
                "torchft replica groups: only GuardConfig(mode='exact') in this version (tolerant "
                "mode's calibration does not yet follow quorum changes)"
            )
        if config.global_item_count:
            raise GuardConfigError(
                "torchft replica groups: GuardConfig(global_item_count=True) is not supported yet "
                "(its item count is summed over torch.distributed's group, not torchft's)"
            )
        self.health = TorchftGradHealth(self.manager, digest_reduced=config.check_reduced)
        return self.health

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return AloneReplays(params)

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        return nullcontext() if sync else self.ddp.no_sync()

    def sync_off(self) -> str | None:
        if not self.ddp.require_backward_grad_sync:
            return "DDP's gradient sync is off (inside no_sync())"
        return None

    @contextmanager
    def failing_backward(self, synced: bool) -> Iterator[None]:
        # A group whose backward fails votes its step down through the manager (TorchftGuard);
        # the other groups' all-reduces then fail or time out and vote theirs down too.
        yield


def _refuse(manager: Any, pg: Any, module: torch.nn.Module) -> None:
    """What this slice does not support, refused before anything is built."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, DistributedDataParallel):
        raise GuardConfigError(
            "TorchftReplicas takes the bare module (it builds the DDP wrapper torchft's averaging "
            "runs in); do not wrap it in DistributedDataParallel or torchft's DistributedDataParallel"
        )
    if isinstance(module, FSDPModule) or any(hasattr(p, "device_mesh") for p in module.parameters()):
        raise GuardConfigError(
            "torchft replica groups: FSDP2 inside a replica group is not supported yet (one rank "
            "per group, the whole model replicated)"
        )
    # torchft has no public accessor for these three; they are what the Manager was built with.
    if getattr(manager, "_pg", pg) is not pg:
        raise GuardConfigError("pg must be the process group given to the torchft Manager")
    if getattr(manager, "_use_async_quorum", False):
        raise GuardConfigError(
            "torchft replica groups: Manager(use_async_quorum=False) is required (the guard reads "
            "the quorum's membership before the forward, and a healed group's state must be in "
            "place before it computes)"
        )
    group_size = getattr(manager, "_group_world_size", 1)
    if group_size != 1:
        raise GuardConfigError(
            f"torchft replica groups of {group_size} ranks are not supported yet: one rank per "
            "replica group (Manager(world_size=1)) in this version"
        )
