"""A guarded DDP training job on the small decoder: the job run by tests, campaigns and demos."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck import fingerprint as fp
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.launch import RankContext
from replicheck.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

Setup = Callable[[RankContext, torch.nn.Module, torch.optim.Optimizer, Guard], Any]
"""Called on every rank after the guard is built (install faults, hooks...); must be picklable."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training run."""

    steps: int = 20
    """Steps to run (from ``guard.start_step``)."""
    batch: int = 4
    """Sequences per rank per step."""
    model: DecoderConfig = field(default_factory=DecoderConfig)
    """Decoder shape."""
    guard: GuardConfig | None = field(default_factory=GuardConfig)
    """Guard configuration; ``None`` runs the plain, unguarded DDP loop."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the weights and of the data."""
    setup: Setup | None = None
    """Per-rank setup hook run after the guard is built."""
    microbatches: int = 1
    """Split each step's batch into this many micro-batches (gradient accumulation)."""
    keep_state: bool = False
    """Return the final model state dict (CPU tensors) in the result."""


@dataclass
class JobResult:
    """What one rank reports back."""

    rank: int
    node: str
    losses: dict[int, float] = field(default_factory=dict)
    verified_steps: list[int] = field(default_factory=list)
    incident: dict[str, Any] | None = None
    last_step: int = -1
    weights_digest: int = 0
    state: dict[str, torch.Tensor] | None = None
    setup_result: Any = None


def build(spec: JobSpec, ctx: RankContext) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(spec.model, seed=spec.seed)
    ddp = DistributedDataParallel(model) if ctx.world_size > 1 else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=spec.lr)
    return ddp, opt


def batch_for(spec: JobSpec, step: int, rank: int) -> list[dict[str, torch.Tensor]]:
    full = synthetic_batch(spec.model, step=step, rank=rank, batch=spec.batch, seed=spec.seed)
    if spec.microbatches == 1:
        return [full]
    parts = [dict(zip(full, vals)) for vals in zip(*(v.chunk(spec.microbatches) for v in full.values()))]
    return parts


def train(ctx: RankContext, spec: JobSpec) -> JobResult:
    """Run ``spec`` on this rank until done or until the guard stops a step."""
    model, opt = build(spec, ctx)
    result = JobResult(rank=ctx.rank, node=ctx.node)
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    if spec.guard is None:
        for s in range(spec.steps):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, batch_for(spec, s, ctx.rank)[0])
            loss.backward()
            opt.step()
            result.losses[s], result.last_step = float(loss), s
    else:
        guard = Guard(model, opt, lm_loss, config=spec.guard, node=ctx.node)
        if spec.setup is not None:
            result.setup_result = spec.setup(ctx, model, opt, guard)
        start = spec.guard.start_step
        try:
            for s in range(start, start + spec.steps):
                out = guard.step(*batch_for(spec, s, ctx.rank))
                result.losses[s], result.last_step = out.loss, s
                if out.verified:
                    result.verified_steps.append(s)
        except CorruptionDetected as exc:
            result.incident = exc.incident.to_dict()
    result.weights_digest = int(fp.combine(fp.digests(list(bare.parameters()))))
    if spec.keep_state:
        result.state = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    return result
