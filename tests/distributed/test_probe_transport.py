"""Probe passes across ranks: replayed batches on the module's device, strict determinism with
the math attention backend, a clear error on every rank for an op without a deterministic
kernel, and a bit-identical resume with dropout."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from test_comm_exchange import _p2p_spy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import replicheck.guard.step.replay as probe_module
from replicheck.guard import (
    CorruptionDetected,
    DeterminismError,
    Guard,
    GuardConfig,
    PeerFailed,
    current_pass,
    current_step,
)
from replicheck.guard.transport.batch import tree_leaves
from replicheck.harness.launch import RankContext, node_names, run_local


class Features(NamedTuple):
    x: torch.Tensor
    extra: dict[str, torch.Tensor]


@dataclasses.dataclass
class Sample:
    features: Features
    target: list[torch.Tensor]


def _sample(step: int, rank: int, n: int = 4) -> Sample:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(n, 4, generator=g)
    return Sample(features=Features(x=x, extra={"w": torch.ones(n)}), target=[x.sum(-1)])


def _sample_loss(module: nn.Module, batch: Sample) -> torch.Tensor:
    pred = module(batch.features.x).squeeze(-1) * batch.features.extra["w"]
    return (pred - batch.target[0]).square().mean()


def _device_job(ctx: RankContext, break_arbiter: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    param_device = next(model.parameters()).device
    moved: list[tuple[Any, torch.device]] = []  # (batch object, device asked for); kept alive for id()
    real_to_device = probe_module.to_device

    def spy(batch: Any, device: torch.device) -> Any:
        out = real_to_device(batch, device)
        moved.append((out, device))
        return out

    probe_module.to_device = spy  # this process only: the recompute module looks it up at call time
    replays: list[tuple[int, bool, list[str], str]] = []

    def loss_fn(module: nn.Module, batch: Sample) -> torch.Tensor:
        if current_pass() == "replay":
            from_spy = any(out is batch and dev == param_device for out, dev in moved)
            devices = [str(t.device) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
            replays.append((current_step(), from_spy, devices, type(batch).__name__))
            second = sum(1 for s, *_ in replays if s == 2) == 2
            if break_arbiter and ctx.rank != 1 and second:
                raise RuntimeError("the arbiter's replay broke")
        return _sample_loss(module, batch)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, loss_fn, config=GuardConfig(verify_every=1, probe="extra"), node=ctx.node)
    if ctx.rank == 1:
        # Wrong only when rank 1 replays someone else's probe: a lone failing pair, so the third
        # rank arbitrates (replaying the probe it receives) and rank 1 re-runs its replay.
        def fault(mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
            return out + 1.0 if current_step() >= 2 and current_pass() == "replay" else None

        model.module[0].register_forward_hook(fault)
    outcome = "no alarm"
    with _p2p_spy() as p2p:
        try:
            for s in range(4):
                guard.step(_sample(s, ctx.rank))
        except CorruptionDetected as exc:
            outcome = f"corruption at {exc.incident.step}: {list(exc.incident.suspect_ranks)}"
        except (RuntimeError, PeerFailed) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    return {"replays": replays, "outcome": outcome, "p2p": dict(p2p)}


@pytest.mark.timeout(180)
def test_replayed_batches_are_moved_to_the_parameters_device() -> None:
    """Every replay (ring, arbitration, re-run) runs on a batch that went through to_device with
    the parameters' device, rebuilt as the user's dataclass and named tuple; the guard's exchanges
    go through grouped batches only (no bare isend/irecv)."""
    results = run_local(_device_job, node_names(3, 1), timeout=150)
    assert {r["outcome"] for r in results} == {"corruption at 2: [1]"}
    arbiter = [r for r in results if sum(1 for s, *_ in r["replays"] if s == 2) >= 2]
    assert arbiter, "no rank replayed twice at the faulty step (arbitration or re-run)"
    for r in results:
        # ring exchanges of steps 0-2 (lengths, then data), plus arbitration for some ranks
        assert r["p2p"]["bare"] == 0 and r["p2p"]["batches"] >= 6, r["p2p"]
        assert r["replays"], "every rank replays its source's probe"
        for step, from_spy, devices, kind in r["replays"]:
            assert from_spy, (step, devices)
            assert kind == "Sample" and devices and set(devices) == {"cpu"}


@pytest.mark.timeout(180)
def test_an_error_in_an_arbitration_replay_stops_every_rank() -> None:
    """The arbiter's replay raising does not leave the other ranks in the failure path's
    collectives: the arbiter raises its error, every other rank PeerFailed naming it."""
    outcomes = [r["outcome"] for r in run_local(_device_job, node_names(3, 1), args=(True,), timeout=150)]
    broke = [o for o in outcomes if o.startswith("RuntimeError: the arbiter's replay broke")]
    peers = [o for o in outcomes if o.startswith("PeerFailed: step 2 stopped")]
    assert len(broke) == 1 and len(peers) == 2, outcomes


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[tuple[str, bool, bool, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(
            (
                current_pass(),
                torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            )
        )
        q = self.proj(x).view(x.shape[0], 2, -1, 4)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).flatten(1).sum(-1)


def _attn_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]) - batch["y"]).square().mean()


def _sdpa_job(ctx: RankContext, probe: str) -> list[tuple[str, bool, bool, bool, bool]]:
    torch.manual_seed(0)
    inner = _Attention()
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = GuardConfig(verify_every=1, probe=probe, loss_reduction="sample_mean")  # type: ignore[arg-type]
    guard = Guard(model, opt, _attn_loss, config=cfg, node=ctx.node)
    for s in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s * 10 + ctx.rank))
        guard.step({"x": x, "y": x.sum(-1)})
    return inner.seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("probe", ["split", "extra"])
def test_probe_passes_pin_math_attention_and_strict_determinism(probe: str) -> None:
    """Probe and replay passes see only the math SDPA backend and strict deterministic algorithms;
    training passes see the user's defaults (all backends, determinism off)."""
    seen = run_local(_sdpa_job, node_names(2, 1), args=(probe,), timeout=100)[0]
    kinds = {p for p, *_ in seen}
    assert {"probe", "replay", "train"} <= kinds, kinds
    for pass_, fused, math, det, warn_only in seen:
        if pass_ in ("probe", "replay"):
            assert (fused, math, det, warn_only) == (False, True, True, False), pass_
        else:
            assert (fused, det) == (True, False), pass_


class _Unpooled(nn.Module):
    """max_unpool has no deterministic kernel on CPU (torch raises under strict determinism)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, idx = F.max_pool1d(self.lin(x).unsqueeze(1), 2, return_indices=True)
        return F.max_unpool1d(h, idx, 2).squeeze(1).sum(-1)


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]) - batch["y"]).square().mean()


def _nondeterministic_job(ctx: RankContext, probe: str) -> list[tuple[int, str, str]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(_Unpooled())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = GuardConfig(verify_every=2, probe=probe, loss_reduction="sample_mean")  # type: ignore[arg-type]
    guard = Guard(model, opt, _mse, config=cfg, node=ctx.node)
    out: list[tuple[int, str, str]] = []
    for s in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(s * 10 + ctx.rank))
        try:
            guard.step({"x": x, "y": x.sum(-1)})
            out.append((s, "ok", ""))
        except (DeterminismError, PeerFailed) as exc:
            out.append((s, type(exc).__name__, str(exc)))
            break
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("probe", ["split", "extra"])
def test_op_without_deterministic_kernel_stops_every_rank_with_a_clear_error(probe: str) -> None:
    """The first verification step ends on every rank (no hang): the ranks that hit the op raise
    DeterminismError naming it and pointing to tolerant mode; no rank applies the step."""
    results = run_local(_nondeterministic_job, node_names(2, 1), args=(probe,), timeout=100)
    for per_rank in results:
        assert per_rank[0] == (0, per_rank[0][1], per_rank[0][2]) and len(per_rank) == 1, per_rank
        assert per_rank[0][1] in ("DeterminismError", "PeerFailed")
    errors = [r[0][2] for r in results if r[0][1] == "DeterminismError"]
    assert errors, results
    assert all("max_unpool" in e and "mode='tolerant'" in e for e in errors)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _run(guard: Guard, steps: range, rank: int) -> None:
    for s in steps:
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(s * 10 + rank))
        guard.step({"x": x, "y": x.sum(-1)})


def _resume_job(ctx: RankContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cfg = GuardConfig(verify_every=2, weights_every=3)
    torch.manual_seed(0)
    model = DistributedDataParallel(_Dropout())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, _mse, config=cfg, node=ctx.node)
    _run(guard, range(0, 3), ctx.rank)
    saved = (copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
    _run(guard, range(3, 7), ctx.rank)
    continuous = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(123)  # a fresh process would start from another RNG state
    resumed_model = _Dropout()
    resumed_model.load_state_dict(saved[0])
    resumed = DistributedDataParallel(resumed_model)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(saved[1])
    torch.set_rng_state(saved[2])
    resumed_guard = Guard(
        resumed, resumed_opt, _mse, config=dataclasses.replace(cfg, start_step=3), node=ctx.node
    )
    _run(resumed_guard, range(3, 7), ctx.rank)
    return continuous, [p.detach().clone() for p in resumed.parameters()]


@pytest.mark.timeout(180)
def test_resumed_run_with_dropout_is_bit_identical() -> None:
    """A run resumed from a checkpoint (with the bucket-rebuild pass) ends with the same bits as
    the uninterrupted run although dropout draws from the generator on every training pass."""
    for continuous, resumed in run_local(_resume_job, node_names(2, 1), timeout=150):
        assert all(torch.equal(a, b) for a, b in zip(continuous, resumed))
