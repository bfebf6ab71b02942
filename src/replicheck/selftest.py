"""The known-answer self-test: a fixed, seeded forward/backward pass whose exact fingerprint a
healthy node reproduces bit for bit. Triage runs it on a suspect node and compares the
fingerprint with the same computation on a healthy node of the same kind. Imports torch (the
controller only runs it as a separate process)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from replicheck.fingerprint import tensor_digest


@dataclass(frozen=True, kw_only=True)
class SelftestConfig:
    """The computation. Every node compared must use the same values."""

    seed: int = 20240611
    """Seed of the weights and inputs."""
    width: int = 256
    """Hidden width of the MLP (larger exercises more of the matmul units)."""
    depth: int = 4
    """Number of linear layers."""
    batch: int = 64
    """Rows of the input batch."""
    steps: int = 3
    """SGD steps (each a forward and a backward); later steps use earlier results."""
    device: str = "cpu"
    """Where to run (``cuda``, ``cuda:1``, ``cpu``)."""

    def __post_init__(self) -> None:
        for name in ("width", "depth", "batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SelftestConfig.{name} must be >= 1")


@dataclass(frozen=True)
class SelftestResult:
    """What one run produced."""

    fingerprint: str
    """16 hex digits over the losses, gradients and final weights (exact bits)."""
    loss: float
    """Loss of the last step (for a human; the fingerprint is what is compared)."""
    device: str
    seconds: float


def run_selftest(config: SelftestConfig | None = None) -> SelftestResult:
    """Run the fixed computation deterministically and fingerprint every intermediate result."""
    cfg = config or SelftestConfig()
    device = torch.device(cfg.device)
    started = time.perf_counter()
    previous = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    # One CPU thread: a BLAS that adapts its thread count to the machine's load splits the
    # reductions differently, and a known answer must not depend on how busy the node is.
    torch.set_num_threads(1)
    try:
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        weights = [
            (torch.randn(cfg.width, cfg.width, generator=gen) / cfg.width**0.5).to(device).requires_grad_()
            for _ in range(cfg.depth)
        ]
        x = torch.randn(cfg.batch, cfg.width, generator=gen).to(device)
        target = torch.randn(cfg.batch, cfg.width, generator=gen).to(device)
        h = hashlib.blake2b(digest_size=8)
        loss = torch.zeros(())
        for _ in range(cfg.steps):
            out = x
            for w in weights:
                out = torch.tanh(out @ w)
            loss = torch.mean((out - target) ** 2)
            grads = torch.autograd.grad(loss, weights)
            for t in (loss.detach(), *grads):
                h.update(tensor_digest(t).to_bytes(8, "little", signed=True))
            with torch.no_grad():
                for w, g in zip(weights, grads):
                    w.sub_(0.1 * g)
        for w in weights:
            h.update(tensor_digest(w.detach()).to_bytes(8, "little", signed=True))
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.set_num_threads(threads)
    return SelftestResult(h.hexdigest(), float(loss.item()), str(device), time.perf_counter() - started)
