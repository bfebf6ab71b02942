"""The few collectives the guard needs, over a torch.distributed process group.

Every tensor given to a collective is held in :data:`~replicheck.guard.transport.inflight.IN_FLIGHT` until
the backend has released it (see that module: an abort at interpreter exit otherwise).

Devices: the communication device (:attr:`Comm.device`) is where collectives move tensors. It
follows the model's compute device and the group's backend *for that device type*
(:func:`comm_device`): the compute device when the group has a device backend for it (NCCL for
CUDA, also under ``"cpu:gloo,cuda:nccl"`` or a default ``init_process_group()``), else the host.
Every received message is decoded on the host (:func:`~replicheck.guard.transport.batch.unpack`:
one counted device→host transfer per message, each tensor its own allocation); the code that
computes with a decoded tensor moves it to the compute device itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from replicheck.guard.errors import CommError
from replicheck.guard.transport.batch import pack, unpack
from replicheck.guard.transport.inflight import IN_FLIGHT
from replicheck.guard.transport.transfer import to_host

T = TypeVar("T")

_HOST_BACKENDS = frozenset({"gloo", "mpi"})
"""Backends that move device tensors through the host (a device tensor given to them is staged):
a guard message is then built on the host to begin with."""


def device_backends(config: str) -> dict[str, str]:
    """Device type → backend of a group, from its backend configuration string.

    ``config`` is what ``torch.distributed.get_backend_config(group)`` returns
    (``"cpu:gloo,cuda:nccl"``), or a backend name as given to ``init_process_group``
    (``"nccl"``, ``"gloo"``; ``"undefined"`` or ``""``: torch's default backend of each device
    type).
    """
    text = config.strip().lower()
    if ":" in text:
        out: dict[str, str] = {}
        for pair in text.split(","):
            device, sep, backend = pair.strip().partition(":")
            if not sep or not device or not backend or device in out:
                raise CommError(f"cannot read the process group's backend configuration {config!r}")
            out[device] = backend
        return out
    if text in ("", "undefined"):
        return dict(dist.Backend.default_device_backend_map)
    capability: dict[str, list[str]] = getattr(dist.Backend, "backend_capability", {})
    return dict.fromkeys(capability.get(text, ["cpu", "cuda"]), text)


def comm_device(config: str, compute: torch.device) -> torch.device:
    """The communication device of a group with backend configuration ``config`` for a model
    computing on ``compute``: ``compute`` itself when the group has a device backend for its type
    (``cuda:nccl``), else the host. Raises :class:`CommError` when the group moves neither."""
    backends = device_backends(config)
    if compute.type not in ("cpu", "meta"):
        backend = backends.get(compute.type)
        if backend is not None and backend not in _HOST_BACKENDS:
            return compute
    if "cpu" in backends:
        return torch.device("cpu")
    raise CommError(
        f"the process group's backend ({config!r}) moves neither {compute.type} tensors nor host "
        f"tensors; for a model on {compute} initialise it with a backend for {compute.type} "
        "(e.g. init_process_group('cpu:gloo,cuda:nccl'))"
    )


def default_compute() -> torch.device:
    """The compute device assumed when none is given: the current accelerator, else the host."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


class Comm:
    """Collectives of one process group; world size 1 short-circuits every call but
    :meth:`exchange` (see there)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        compute: torch.device | None = None,
    ) -> None:
        """``device``: the communication device, when the caller decides it (tests inject one);
        otherwise it follows ``compute``, the model's compute device (default: the current
        accelerator, else the host), and the group's backend for that device type
        (:func:`comm_device`)."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        if device is None:
            where = compute if compute is not None else default_compute()
            device = comm_device(dist.get_backend_config(group), where) if self.distributed else where
        self.device = torch.device(device)
        """Where collectives move tensors (module docstring)."""
        self._p2p_ready = False

    def _keep(self, *tensors: torch.Tensor) -> None:
        IN_FLIGHT.hold(tensors)

    # -- the group's primitives: a subclass over a group torch.distributed does not know (torchft's
    # reconfigurable one) overrides these three and :meth:`_grouped`, and nothing else ------------
    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduce ``t`` in place over the group (synchronous)."""
        dist.all_reduce(t, op=op, group=self.group)

    def _all_gather_into(self, out: torch.Tensor, local: torch.Tensor) -> None:
        """Every rank's 1-D ``local`` into the flat ``out`` (rank order), synchronous."""
        _all_gather_single(out, local, self.group)

    def global_rank(self, group_rank: int) -> int:
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """All-gather one 1-D int64 row per rank into a ``(world, len)`` CPU tensor.

        One collective into one output tensor (no per-rank allocation) and one counted
        device→host transfer: after the all-gather where the group moves device tensors (NCCL),
        before it where it moves host tensors (gloo).
        """
        if self.world_size == 1:
            return to_host(row.reshape(1, -1), "step row").clone()
        local = to_host(row, "step row") if self.device.type == "cpu" else row.to(self.device)
        out = self._all_gather(local.reshape(-1))
        return out if self.device.type == "cpu" else to_host(out, "step row")

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``local`` (same length everywhere) as a ``(world, len)`` tensor on its
        device: one collective into one flat output."""
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=local.device)
        self._all_gather_into(out, local)
        self._keep(local, out)
        return out.view(self.world_size, -1)

    def max_int(self, value: int) -> int:
        """The largest ``value`` any rank gives (waits for every rank)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._all_reduce(t, dist.ReduceOp.MAX)
        self._keep(t)
        return int(to_host(t, "pass count")[0])

    def flagged(self, flag: bool, why: str = "failure flags") -> list[int]:
        """The ranks that gave ``flag=True`` (waits for every rank).

        One 8-byte all-reduce on the communication device and one counted transfer, whatever the
        world size; only when some rank raised its flag (a failure path) does a second collective
        say which ones. No host-only group is needed, so no whole-world TCP mesh under NCCL.
        """
        if self.world_size == 1:
            return [0] if flag else []
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        self._all_reduce(t, dist.ReduceOp.SUM)
        self._keep(t)
        if not int(to_host(t, why)[0]):
            return []
        local = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        every = to_host(self._all_gather(local), why)
        return [r for r, f in enumerate(every[:, 0].tolist()) if f]

    def gather_objects(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (pickled), indexed by rank."""
        if self.world_size == 1:
            return [obj]
        # Not all_gather_object: its tensors are torch's own, which this class cannot keep alive.
        data = pack(obj).to(self.device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [int(n) for n in to_host(self._all_gather(length), "object lengths")[:, 0].tolist()]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        out = self._all_gather(padded)
        return [cast(T, self._received(t[:n])) for t, n in zip(out, sizes)]

    def exchange(self, sends: Sequence[tuple[int, object]], recv_from: Sequence[int]) -> dict[int, object]:
        """Send each ``(dest, obj)`` and receive one object from every rank in ``recv_from``.

        Collective: every rank of the group calls it at the same point, also a rank with nothing
        to send or receive. The lengths, then the data, travel as one grouped
        ``batch_isend_irecv`` each, so no pattern of pairs (a ring included) can deadlock on the
        order in which ranks post their sends and receives, which separate ``isend``/``irecv``
        calls can under NCCL. At most one message per pair and direction.

        Received objects are decoded on the host (:meth:`_received`). At world size 1 (a rank
        that is its own verifier) each message still takes the whole path, packed, moved to the
        communication device and decoded from there, so a one-process job over NCCL runs what a
        multi-rank one does: the receiver never sees the sender's Python objects.
        """
        _check_pattern(self.rank, self.world_size, [dst for dst, _ in sends], list(recv_from))
        if self.world_size == 1:
            # A loopback of the message path (no collective: one process has no peer).
            looped = [pack(obj).to(self.device) for _, obj in sends]
            return {src: self._received(data) for data, src in zip(looped, recv_from)}
        self._ensure_p2p_ready()
        payloads = [(dst, pack(obj).to(self.device)) for dst, obj in sends]
        lengths_out = [
            (dst, torch.tensor([p.numel()], dtype=torch.int64, device=self.device)) for dst, p in payloads
        ]
        lengths_in = [(src, torch.zeros(1, dtype=torch.int64, device=self.device)) for src in recv_from]
        self._grouped(lengths_out, lengths_in)
        sizes = (
            to_host(torch.cat([n for _, n in lengths_in]), "exchange lengths").tolist() if lengths_in else []
        )
        data_in = [
            (src, torch.empty(int(n), dtype=torch.uint8, device=self.device))
            for (src, _), n in zip(lengths_in, sizes)
        ]
        self._grouped(payloads, data_in)
        return {src: self._received(t) for src, t in data_in}

    def _received(self, data: torch.Tensor) -> object:
        """A received message (on the communication device) decoded on the host: one counted
        device→host transfer, each tensor in its own allocation."""
        return unpack(data)

    def _ensure_p2p_ready(self) -> None:
        """One collective over the group before its first point-to-point batch.

        NCCL requires every rank of the group in the group's first collective call; a batch that
        involves only some ranks (arbitration) is allowed only after that. Every rank calls
        :meth:`exchange` at the same points, so this runs on every rank alike.
        """
        if not self._p2p_ready:
            # A device all-reduce: no host transfer, nothing to wait for here.
            ready = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._all_reduce(ready, dist.ReduceOp.SUM)
            self._keep(ready)
            self._p2p_ready = True

    def _grouped(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Post ``sends`` and ``recvs`` (group ranks) as one batch and wait for all of them."""
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=dst) for dst, t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=src) for src, t in recvs]
        if not ops:
            return  # torch refuses an empty batch; this rank takes no part in this exchange
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self._keep(*(t for _, t in sends), *(t for _, t in recvs))


def _all_gather_single(out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather into one flat tensor: ``all_gather_single`` where torch has it (it deprecates
    ``all_gather_into_tensor``), else ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def _check_pattern(rank: int, world_size: int, dests: Sequence[int], sources: Sequence[int]) -> None:
    """Refuse what the grouped exchange cannot match: a peer twice, this rank, or no such rank."""
    for kind, peers in (("destination", dests), ("source", sources)):
        if len(set(peers)) != len(peers):
            raise CommError(f"exchange: a {kind} appears twice in {list(peers)}")
        bad = [p for p in peers if not 0 <= p < world_size or (p == rank and world_size > 1)]
        if bad:
            raise CommError(f"exchange: invalid {kind} rank(s) {bad} on rank {rank} of {world_size}")
