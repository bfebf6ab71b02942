"""A guarded DDP training job on the small decoder: the job run by tests, campaigns and demos."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck import fingerprint as fp
from replicheck.checkpoint.policy import Policy
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.guard.modules import unwrap
from replicheck.harness.launch import RankContext
from replicheck.harness.workloads import (
    DecoderConfig,
    lm_loss,
    lm_loss_bf16,
    lm_loss_fp16,
    make_model,
    padded_batch,
    synthetic_batch,
    token_mean_loss,
    token_sum_loss,
)

JobLoss = Literal["lm", "lm_bf16", "lm_fp16", "token_sum"]
"""The job's loss (see :attr:`JobSpec.loss`)."""

Parallel = Literal["ddp", "fsdp", "hsdp"]
"""How the job spreads the model (see :attr:`JobSpec.parallel`)."""

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
    checkpoint_dir: str | None = None
    """Directory of a :class:`replicheck.checkpoint.CheckpointStore` (guarded runs only); ``None``: no checkpoints."""
    checkpoint_every: int = 0
    """Save a verified checkpoint after every step ``s`` with ``s % checkpoint_every == 0`` (0: never)."""
    checkpoint_keep: int = 5
    """Checkpoints retention keeps (besides the current resume point)."""
    resume: bool = False
    """Before the first step, restore the store's resume point and start at its step + 1; start
    from scratch when there is none."""
    resume_incident: str | None = None
    """With ``resume``: the incident (JSON text or file path) to resume after; the resume point is
    then the newest checkpoint not after its last passing verification."""
    resume_policy: Policy = "last_pass"
    """With ``resume_incident``: ``last_pass`` or ``two_passes`` (intermittent faults)."""
    report_every: int = 0
    """Rank 0 prints step, loss and verification as it trains, every this many steps (0: silent)."""
    loss: JobLoss = "lm"
    """``lm``: :func:`~replicheck.harness.workloads.lm_loss`; ``lm_bf16``: the same with the
    forward under bf16 autocast; ``lm_fp16``: under fp16 autocast, trained with a
    ``torch.amp.GradScaler`` (guarded and plain); ``token_sum``: padded Hugging Face shaped batches and the
    token-mean loss stated as a ``LossSum`` (the plain loop uses the token mean)."""
    stop_step: int | None = None
    """When set, run up to this step index (exclusive) instead of ``steps`` steps, so a requeued
    job can resume with the same spec."""
    parallel: Parallel = "ddp"
    """``ddp``: DistributedDataParallel; ``fsdp``: FSDP2 (``fully_shard`` on each block and the
    root, one mesh over every rank); ``hsdp``: the same on a 2-D mesh of ``replicas`` replica
    groups, each sharding over ``world / replicas`` ranks."""
    replicas: int = 2
    """Replica groups of an ``hsdp`` job."""


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
    resumed_from: int | None = None
    checkpoints: list[int] = field(default_factory=list)


def build(spec: JobSpec, ctx: RankContext) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(spec.model, seed=spec.seed)
    if spec.parallel != "ddp":
        wrapped: torch.nn.Module = shard(
            model, ctx.world_size, spec.replicas if spec.parallel == "hsdp" else 1
        )
    else:
        wrapped = DistributedDataParallel(model) if ctx.world_size > 1 else model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=spec.lr)
    return wrapped, opt


def bare_device(module: torch.nn.Module) -> str:
    """The device type ``module``'s parameters live on."""
    return next(module.parameters()).device.type


def shard(model: torch.nn.Module, world_size: int, replicas: int = 1) -> torch.nn.Module:
    """``model`` (a decoder) sharded with ``fully_shard``: each block, then the root. With
    ``replicas > 1`` the mesh is 2-D (HSDP): replicas × (world_size / replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if replicas > 1:
        mesh = init_device_mesh(
            "cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for block in model.blocks:  # type: ignore[union-attr]  # the decoder's blocks
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # changes the module's class in place
    return model


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as whole CPU tensors (a collective for a sharded module)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def batch_for(spec: JobSpec, step: int, rank: int) -> list[dict[str, torch.Tensor]]:
    make = padded_batch if spec.loss == "token_sum" else synthetic_batch
    full = make(spec.model, step=step, rank=rank, batch=spec.batch, seed=spec.seed)
    if spec.microbatches == 1:
        return [full]
    parts = [dict(zip(full, vals)) for vals in zip(*(v.chunk(spec.microbatches) for v in full.values()))]
    return parts


def _checkpointing(
    spec: JobSpec,
    gcfg: GuardConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    result: JobResult,
    ctx_rank: int,
) -> tuple[Any, GuardConfig]:
    """The job's checkpoint store (or None) and the guard config, resumed when asked."""
    if spec.checkpoint_dir is None:
        return None, gcfg
    from dataclasses import replace

    from replicheck.checkpoint import CheckpointStore

    store = CheckpointStore(spec.checkpoint_dir, keep=spec.checkpoint_keep)
    if not spec.resume or not store.directory.is_dir():
        return store, gcfg
    point = store.resume_point(spec.resume_incident, policy=spec.resume_policy)
    if point is None:
        if spec.resume_incident is not None and ctx_rank == 0:
            store.retire_after(-1)  # none is clean: every checkpoint belongs to the abandoned run
        return store, gcfg
    step = store.load(point, model, opt)
    result.resumed_from = step
    return store, replace(gcfg, start_step=step + 1)


def train(ctx: RankContext, spec: JobSpec) -> JobResult:
    """Run ``spec`` on this rank until done or until the guard stops a step."""
    model, opt = build(spec, ctx)
    result = JobResult(rank=ctx.rank, node=ctx.node)
    bare = unwrap(model)
    loss_fn: Any = {
        "lm": lm_loss,
        "lm_bf16": lm_loss_bf16,
        "lm_fp16": lm_loss_fp16,
        "token_sum": token_sum_loss,
    }[spec.loss]
    scaler = torch.amp.GradScaler(bare_device(bare)) if spec.loss == "lm_fp16" else None
    if spec.guard is None:
        if spec.loss == "token_sum":
            loss_fn = token_mean_loss
        for s in range(spec.steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch_for(spec, s, ctx.rank)[0])
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            result.losses[s], result.last_step = float(loss.detach()), s
    else:
        store, gcfg = _checkpointing(spec, spec.guard, model, opt, result, ctx.rank)
        if store is not None and store.loaded is not None:
            # The resumed guard continues the lineage's verification record.
            gcfg = dataclasses.replace(gcfg, resume_verified_step=store.loaded.checkpoint.last_verified_step)
        if gcfg.loss_reduction == "unknown" and spec.loss != "token_sum":
            # lm_loss averages sequences of one length: a per-sample mean, so a split is exact.
            gcfg = dataclasses.replace(gcfg, loss_reduction="sample_mean")
        guard = Guard(model, opt, loss_fn, config=gcfg, node=ctx.node, scaler=scaler)
        if spec.setup is not None:
            result.setup_result = spec.setup(ctx, model, opt, guard)
        start = gcfg.start_step
        stop = spec.stop_step if spec.stop_step is not None else start + spec.steps
        try:
            for s in range(start, stop):
                out = guard.step(*batch_for(spec, s, ctx.rank))
                result.losses[s], result.last_step = out.loss, s
                if out.verified:
                    result.verified_steps.append(s)
                if spec.report_every and ctx.rank == 0 and (s % spec.report_every == 0 or out.verified):
                    check = "  replay passed" if out.verified else ""
                    print(f"          train       step {s:3d}  loss {out.loss:.4f}{check}", flush=True)
                if store is not None and spec.checkpoint_every > 0 and s % spec.checkpoint_every == 0:
                    store.save(s, model, opt, guard=guard)
                    result.checkpoints.append(s)
        except CorruptionDetected as exc:
            result.incident = exc.incident.to_dict()
    if spec.parallel == "ddp":
        result.weights_digest = fp.model_digest(bare, "all")
        if spec.keep_state:
            result.state = {k: v.detach().clone() for k, v in bare.state_dict().items()}
        return result
    state = full_state(bare)  # every rank takes part: the shards are gathered
    result.weights_digest = fp.weights_digest(state[k] for k, _ in bare.named_parameters())
    if spec.keep_state:
        result.state = state
    return result
