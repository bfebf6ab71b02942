"""Shared helpers of the checkpoint tests: a tiny model, a stand-in guard, corruption tools."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replicheck.checkpoint import CheckpointStore
from replicheck.guard.transport.comm import Comm
from replicheck.incident import Incident


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model with one AdamW step taken, so the optimizer has state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(5, 8, generator=gen)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class _Cfg:
    verify_every: int = 10


@dataclass
class FakeGuard:
    """What :meth:`CheckpointStore.save` uses of a guard, for single-process tests."""

    last_verified_step: int | None = None
    config: _Cfg = field(default_factory=_Cfg)
    rank: int = 0
    world_size: int = 1
    comm: Comm = field(default_factory=Comm)
    """A real world-size-1 :class:`Comm` (single-process tests have no process group)."""
    checks: int = 0
    fail: Exception | None = None

    def check_replicas(self) -> None:
        self.checks += 1
        if self.fail is not None:
            raise self.fail

    def state_dict(self) -> dict[str, Any]:
        return {"format": "fake", "last_verified_step": self.last_verified_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_verified_step = state["last_verified_step"]


def run_schedule(
    store: CheckpointStore,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    until: int,
    every: int = 5,
    verify_every: int = 10,
) -> dict[int, dict[str, torch.Tensor]]:
    """Train steps 1..until, saving every ``every`` steps as a guard verifying every
    ``verify_every`` would record it; return the model state saved at each step."""
    guard = FakeGuard(config=_Cfg(verify_every))
    saved = {}
    for s in range(1, until + 1):
        train_step(model, opt, s)
        if s % verify_every == 0:
            guard.last_verified_step = s
        if s % every == 0:
            store.save(s, model, opt, guard=guard)
            saved[s] = state(model)
    return saved


def incident(step: int, last_verified: int | None) -> Incident:
    return Incident(
        id=f"job-s{step}-replay",
        job_id="job",
        step=step,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=("node1",),
        classification="persistent",
        last_verified_step=last_verified,
        world_size=3,
    )


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def edit_manifest(ckpt_dir: Path, **changes: Any) -> None:
    p = ckpt_dir / "manifest.json"
    data = json.loads(p.read_text())
    data.update(changes)
    p.write_text(json.dumps(data))
