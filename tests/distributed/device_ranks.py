"""Rank functions for the device-discipline tests (picklable: run in spawned ranks)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.guard.parallel import detect
from replicheck.guard.transport import comm as comm_mod
from replicheck.harness.launch import RankContext


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    return out


def comm_follows_model(ctx: RankContext) -> dict[str, Any]:
    """The guard's communication device for a DDP, an FSDP2 and a CPU-offloaded FSDP2 model:
    what ``comm_device`` was asked (backend configuration, compute device) and what it gave."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    asked: list[tuple[str, torch.device]] = []
    real = comm_mod.comm_device

    def spy(config: str, compute: torch.device) -> torch.device:
        asked.append((config, compute))
        return real(config, compute)

    out: dict[str, Any] = {"config": dist.get_backend_config()}
    with mock.patch.object(comm_mod, "comm_device", spy):
        ddp = DistributedDataParallel(_mlp())
        par = detect(ddp)
        out["ddp"] = (asked[-1], par.comm.device, par.device)
        plain = _mlp()
        fully_shard(plain)
        par = detect(plain)
        out["fsdp"] = (asked[-1], par.comm.device, par.device)
        offloaded = _mlp()
        fully_shard(offloaded, offload_policy=CPUOffloadPolicy(pin_memory=False))
        par = detect(offloaded)
        out["offload"] = (asked[-1], par.comm.device, par.device)
        # A verification step of the offloaded model runs (probe, exchange, replay, compare).
        guard = Guard(
            offloaded,
            torch.optim.SGD(offloaded.parameters(), lr=0.01),
            _loss,
            GuardConfig(verify_every=1, probe_size=2),
            node=ctx.node,
        )
        g = torch.Generator().manual_seed(ctx.rank)
        report = guard.step((torch.randn(8, 6, generator=g), torch.randn(8, generator=g)))
        out["verified"] = report.verified
    # Under offload on a GPU, FSDP's parameter groups compute on the GPU while the parameters
    # stay on the host: a stand-in device name there (no CUDA here) is what the guard must use.
    from replicheck.guard.parallel.fsdp import compute_device

    stand_in = torch.device("cuda", 1)
    other = _mlp()
    fully_shard(other, offload_policy=CPUOffloadPolicy(pin_memory=False))
    for group in other._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
        group.device = stand_in
    out["stand_in"] = (compute_device(other), {p.device for p in other.parameters()})
    return out
