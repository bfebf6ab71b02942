"""Replays on one rank (DDP, one process) fingerprint each gradient as it is produced (issue 23,
finding 9): no second full gradient set is held beside the user's ``.grad``, the fingerprint is
the one of the whole gradient list, and the user's gradients are untouched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from live_bytes import LiveBytes

from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import DiscardedPass
from replicheck.guard.step.replay import Fingerprinter


def _model(layers: int = 16, width: int = 128) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.parametrize("mode", ["exact", "tolerant"])
def test_a_replay_holds_no_second_full_gradient(mode: str) -> None:
    """A replay of a model of sixteen equal layers allocates, at its peak, less than half the
    parameters' bytes (a full second gradient set is all of them), gives the fingerprint of the
    whole gradient list, and leaves every ``.grad`` bit-identical."""
    model = _model()
    params = list(model.parameters())
    x = torch.randn(1, 128)
    model(x).square().sum().backward()
    users = [p.grad.clone() for p in params if p.grad is not None]
    prints = Fingerprinter(mode="exact" if mode == "exact" else "tolerant", sketch_k=4, sketch_block=1024)

    def run() -> torch.Tensor:
        return model(x).square().sum()

    replays = AloneReplays(params)
    with LiveBytes() as mem:
        _, got = replays.fingerprint(DiscardedPass(run=run, weight=0.5, contexts=_nothing), prints, 7)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert mem.peak < 0.5 * param_bytes, (mem.peak, param_bytes)
    want = prints(list(torch.autograd.grad(run() * 0.5, params)), 7)
    assert torch.equal(got.cpu(), want.cpu())
    assert all(p.grad is not None and torch.equal(p.grad, u) for p, u in zip(params, users))
