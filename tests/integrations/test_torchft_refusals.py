"""What the torchft integration does not support is refused with a GuardConfigError that says so,
before any quorum: a group of several ranks without its own process group (or with one of
another size), an FSDP2 module given to the DDP parallelism, FSDP2 over one rank per group, a model already
wrapped in DDP, torchft's async quorum, tolerant mode, ``global_item_count``, a second
``TorchftGuard`` on one manager. Real managers
against a real lighthouse (in this process)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from replicheck.guard import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.torchft import TorchftReplicas
from replicheck.integrations.torchft import TorchftGuard


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).square().mean()


@pytest.fixture(scope="module")
def lighthouse() -> Iterator[str]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    try:
        yield server.address()
    finally:
        server.shutdown()


def _manager(lighthouse: str, pg: Any, *, async_quorum: bool = False, world_size: int = 1) -> Any:
    import torch.distributed as dist
    from torchft import Manager

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ttl = timedelta(seconds=10)
    return Manager(
        pg=pg,
        load_state_dict=lambda sd: None,
        state_dict=lambda: {},
        min_replica_size=1,
        use_async_quorum=async_quorum,
        replica_id="refusals",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=world_size,
        lighthouse_addr=lighthouse,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )


def _pg() -> Any:
    from torchft import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timedelta(seconds=10))


@pytest.mark.timeout(60)
def test_async_quorum_and_groups_of_several_ranks_without_their_group_are_refused(lighthouse: str) -> None:
    """Manager(use_async_quorum=True), and Manager(world_size=2) without the group's own process
    group, are refused, each naming the fix."""
    pg = _pg()
    m = _manager(lighthouse, pg, async_quorum=True)
    try:
        with pytest.raises(GuardConfigError, match="use_async_quorum=False"):
            TorchftReplicas(m, pg, nn.Linear(4, 4))
    finally:
        m.shutdown(wait=False)
    pg = _pg()
    m = _manager(lighthouse, pg, world_size=2)
    try:
        with pytest.raises(GuardConfigError, match="pass the group's own process group as group="):
            TorchftReplicas(m, pg, nn.Linear(4, 4))
    finally:
        m.shutdown(wait=False)


@pytest.mark.timeout(60)
def test_wrapped_models_another_group_and_unsupported_modes_are_refused(lighthouse: str) -> None:
    """A DDP-wrapped model, a process group that is not the manager's, tolerant mode and
    global_item_count are refused; the plain exact-mode setup installs; a second TorchftGuard on
    the same manager is refused (its recovery key is taken)."""
    from torchft.process_group import ProcessGroupDummy

    pg = _pg()
    m = _manager(lighthouse, pg)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(
            nn.Linear(4, 4), process_group=ProcessGroupDummy(0, 1)
        )
        with pytest.raises(GuardConfigError, match="bare module"):
            TorchftReplicas(m, pg, ddp)
        with pytest.raises(GuardConfigError, match="given to the torchft Manager"):
            TorchftReplicas(m, _pg(), nn.Linear(4, 4))
        replicas = TorchftReplicas(m, pg, nn.Linear(4, 4))
        with pytest.raises(GuardConfigError, match="mode='exact'"):
            replicas.install(GuardConfig(mode="tolerant"))
        with pytest.raises(GuardConfigError, match="global_item_count"):
            replicas.install(GuardConfig(global_item_count=True, loss_reduction="sum"))
        assert replicas.install(GuardConfig()) is replicas.health
        # TorchftGuard registers the state torchft's recovery sends under one key: once per manager.
        net = nn.Linear(4, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        TorchftGuard(m, pg, net, opt, _loss)
        with pytest.raises(GuardConfigError, match="one TorchftGuard per Manager"):
            TorchftGuard(m, pg, nn.Linear(4, 4), opt, _loss)
    finally:
        m.shutdown(wait=False)


def _shard_and_refuse(ctx: Any) -> tuple[str, ...]:
    """On a 1-rank gloo job: an FSDP2 module handed to TorchftReplicas is refused (the module is
    checked before the manager, so no manager is needed to see it); a manager of a 2-rank replica
    group given this 1-rank group as the group's own is refused; FSDP2 in a replica group of one
    rank (nothing to shard over) is refused by TorchftGuard."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchft._torchft import LighthouseServer

    messages = []
    try:
        TorchftReplicas(None, None, fully_shard(nn.Linear(4, 4)))
    except GuardConfigError as exc:
        messages.append(str(exc))
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    pg = _pg()
    m = _manager(server.address(), pg, world_size=2)
    try:
        TorchftReplicas(m, pg, nn.Linear(4, 4), group=dist.group.WORLD)
    except GuardConfigError as exc:
        messages.append(str(exc))
    finally:
        m.shutdown(wait=False)
    pg = _pg()
    m = _manager(server.address(), pg)
    sharded = fully_shard(nn.Linear(4, 4))
    try:
        TorchftGuard(m, pg, sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), _loss)
    except GuardConfigError as exc:
        messages.append(str(exc))
    finally:
        m.shutdown(wait=False)
        server.shutdown()
    return tuple(messages) if len(messages) == 3 else (*messages, "accepted")


@pytest.mark.timeout(120)
def test_an_fsdp2_module_and_a_group_of_another_size_are_refused() -> None:
    """A sharded module handed to the DDP-in-a-group parallelism is refused, naming the FSDP2 one
    (TorchftGuard picks it itself); a replica group's own process group whose size is not the
    manager's group size is refused; FSDP2 over a replica group of one rank is refused."""
    from replicheck.harness.launch import node_names, run_local

    ((fsdp, size, alone),) = run_local(_shard_and_refuse, node_names(1, 1), timeout=100)
    assert "TorchftReplicas takes a module that is not sharded" in fsdp and "TorchftSharded" in fsdp
    assert "group= has 1 ranks but the torchft Manager's replica group has 2" in size
    assert "shard over the group's own ranks, 2 or more" in alone
