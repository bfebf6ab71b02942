"""Agreement of state across replicas (weights, optimizer state, reduced gradients) and
the per-step gradient health finding."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.context import running
from replicheck.guard.probe import deterministic, seeded
from replicheck.guard.verdict import Finding, vote

if TYPE_CHECKING:
    from replicheck.guard.core import Guard

_STATE_NOTE = (
    "replicas diverged in stored state; whether the fault recurs cannot be re-run from here, "
    "so the incident is classified transient and should be triaged"
)


def weights_digest(params: Sequence[torch.Tensor]) -> int:
    return int(fp.combine(fp.digests(list(params))))


def optimizer_digest(optimizer: torch.optim.Optimizer) -> int:
    tensors: list[torch.Tensor | None] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
    return int(fp.combine(fp.digests(tensors)))


def vote_finding(check: str, values: Sequence[int]) -> Finding | None:
    """A finding when the ranks' digests of the same state disagree."""
    v = vote([int(x) for x in values])
    if v.agree:
        return None
    evidence: dict[str, Any] = {"digests": [f"{int(x) & 0xFFFF_FFFF_FFFF_FFFF:016x}" for x in values]}
    if not v.dissenters:
        evidence["note"] = "no strict majority: the replicas cannot be told apart"
        return Finding(check=check, candidates=v.candidates, evidence=evidence)
    evidence["note"] = _STATE_NOTE
    return Finding(check=check, suspects=v.dissenters, classification="transient", evidence=evidence)


def findings(weights: Sequence[int], optimizer_state: Sequence[int]) -> list[Finding]:
    out = []
    for check, values in (("weights", weights), ("optimizer_state", optimizer_state)):
        f = vote_finding(check, values)
        if f is not None:
            out.append(f)
    return out


def _healthy(norm: float, bound: float | None) -> bool:
    return math.isfinite(norm) and (bound is None or norm <= bound)


Pass = tuple[Any, float, "int | None"]
"""One backward pass of a step: ``(batch, loss weight, probe seed or None)``."""


def gradient_finding(guard: Guard, bad: list[int], norms: list[float], passes: Sequence[Pass], step: int) -> Finding:
    """Ranks whose local gradient was non-finite or too large; each re-runs its step to classify.

    The re-run repeats the step's passes as they ran (probe and rest when the probe was split
    off), so a fault that depends on the shape of a pass is reproduced. Collective: every rank
    calls this with the same ``bad``.
    """
    bound = guard.config.grad_norm_bound
    evidence: dict[str, Any] = {"local_grad_norms": norms, "bound": bound}
    if len(bad) * 2 > guard.world_size and guard.world_size > 1:
        # Most ranks at once looks like divergence of the model, not one bad device.
        evidence["note"] = "most ranks produced bad gradients: not attributable to one device"
        guard.comm.gather_objects(None)
        return Finding(check="gradients", candidates=tuple(bad), evidence=evidence)
    mine = None
    if guard.rank in bad:
        acc: list[torch.Tensor | None] = [None] * len(guard.params)
        device = guard.params[0].device
        with torch.random.fork_rng(devices=[]), running(step, "replay"):
            for batch, weight, seed in passes:
                ctx = seeded(seed, device) if seed is not None else contextlib.nullcontext()
                with ctx, deterministic(seed is not None and guard.config.use_deterministic):
                    loss = guard.loss_fn(guard.module, batch) * weight
                    grads = torch.autograd.grad(loss, guard.params, allow_unused=True)
                acc = [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
        present = [g.float() for g in acc if g is not None]
        again = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))) \
            if present else 0.0
        mine = {"rank": guard.rank, "rerun_norm": again,
                "classification": "transient" if _healthy(again, bound) else "persistent"}
    reruns = [r for r in guard.comm.gather_objects(mine) if r is not None]
    evidence["reruns"] = reruns
    by_rank = {r["rank"]: r["classification"] for r in reruns}
    return Finding(check="gradients", suspects=tuple(bad), classification=by_rank.get(bad[0], "ambiguous"),
                   evidence=evidence)
