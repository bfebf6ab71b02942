"""The guarded loop on the device: clean, resumed and faulty runs, and the world-size-1 smoke.

Each run builds a fresh DDP model (the small Llama-style decoder with SDPA attention, dropout on
its embeddings so the device RNG matters), a fresh AdamW and a fresh Guard in exact mode, and
trains on the harness's reproducible synthetic batches. Only the public API is used: Guard,
GuardConfig, CorruptionDetected, the fault injector and the checkpoint store.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchkit.settings import CheckSettings
from benchkit.syncs import SyncCounter
from replicheck import fingerprint as fp
from replicheck.checkpoint import CheckpointStore
from replicheck.faults import Fault
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.harness.launch import RankContext
from replicheck.harness.workloads import lm_loss, make_model, synthetic_batch

FAULT_RANK = 1
"""The rank made faulty in the fault runs."""


def forward_fault(onset: int) -> Fault:
    """A persistent bit flip in the first block's feed-forward output (forward and backward see it)."""
    return Fault.at_forward("blocks.0.ffn").persistent(from_step=onset).bitflip(bit=22).on_rank(FAULT_RANK)


def backward_fault(onset: int) -> Fault:
    """A persistent zeroed chunk in one weight gradient only (the forward pass is untouched)."""
    return (
        Fault.at_weight_gradient("blocks.0.ffn.down.weight")
        .persistent(from_step=onset)
        .zero_chunk()
        .on_rank(FAULT_RANK)
    )


def build(
    st: CheckSettings, device: torch.device
) -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    model = make_model(st.small, seed=0).to(device)
    if st.dropout > 0:
        p = st.dropout

        def drop(mod: nn.Module, _inp: Any, out: torch.Tensor) -> torch.Tensor:
            return F.dropout(out, p, mod.training)

        model.embed.register_forward_hook(drop)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def batch_on(st: CheckSettings, step: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    b = synthetic_batch(st.small, step=step, rank=rank, batch=st.small_batch)
    return {k: v.to(device) for k, v in b.items()}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def one_run(
    rank: int,
    node: str,
    st: CheckSettings,
    device: torch.device,
    *,
    fault: Fault | None = None,
    store_dir: str | None = None,
    save_at: int | None = None,
    resume: bool = False,
    steps: int | None = None,
    verify_every: int | None = None,
    count_syncs: bool = False,
) -> dict[str, Any]:
    """One guarded run on this rank; what it saw (incident, verified steps, losses, digest, syncs)."""
    out: dict[str, Any] = {"rank": rank, "node": node, "incident": None, "error": None, "verified": []}
    out["losses"], out["syncs_verify"], out["syncs_ordinary"] = {}, [], []
    try:
        torch.manual_seed(1234)  # the main RNG stream (dropout of training passes), same on every run
        if device.type == "cuda":
            torch.cuda.manual_seed(1234)
        model, ddp, opt = build(st, device)
        store = CheckpointStore(store_dir) if store_dir is not None else None
        start, last_verified = 0, None
        if resume:
            if store is None:
                raise ValueError("resume needs a checkpoint store")
            step = store.load(store.resume_point(), ddp, opt)
            if store.loaded is None:
                raise RuntimeError("the store restored nothing")
            _set_rng_state(store.loaded.extra["rng"], device)
            start, last_verified = step + 1, store.loaded.checkpoint.last_verified_step
            out["resumed_from"] = step
        every = verify_every or st.verify_every
        cfg = GuardConfig(
            verify_every=every,
            weights_every=every,
            mode="exact",
            loss_reduction="sample_mean",
            start_step=start,
            resume_verified_step=last_verified,
        )
        guard = Guard(ddp, opt, lm_loss, config=cfg, node=node)
        if fault is not None:
            fault.install(ddp, optimizer=opt, guard=guard)
        counter = SyncCounter(device)
        for s in range(start, steps or st.steps):
            b = batch_on(st, s, rank, device)
            counts: list[int | None] = []
            with counter.count(counts) if count_syncs else contextlib.nullcontext():
                result = guard.step(b)
            if count_syncs:
                (out["syncs_verify"] if result.verified else out["syncs_ordinary"]).append(counts[0])
            out["losses"][s] = result.loss
            if result.verified:
                out["verified"].append(s)
            if store is not None and save_at == s:
                store.save(s, ddp, opt, guard=guard, extra={"rng": _rng_state(device)})
    except CorruptionDetected as exc:
        out["incident"] = exc.incident.to_dict()
    except Exception:  # noqa: BLE001 - reported in the part's result; the other runs go on
        out["error"] = traceback.format_exc()
    if out["error"] is None:
        out["digest"] = fp.model_digest(model, "all")
    return out


def guard_runs(ctx: RankContext, st: CheckSettings, store_dir: str) -> dict[str, dict[str, Any]]:
    """Every rank of the multi-process part: clean (saving), resumed, forward fault, backward fault."""
    device = torch.device(st.device, 0) if st.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runs: dict[str, dict[str, Any]] = {}
    runs["clean"] = one_run(
        ctx.rank, ctx.node, st, device, store_dir=store_dir, save_at=st.save_at, count_syncs=ctx.rank == 0
    )
    runs["resumed"] = one_run(ctx.rank, ctx.node, st, device, store_dir=store_dir, resume=True)
    runs["forward_fault"] = one_run(ctx.rank, ctx.node, st, device, fault=forward_fault(st.fault_onset))
    runs["backward_fault"] = one_run(ctx.rank, ctx.node, st, device, fault=backward_fault(st.fault_onset))
    return runs


def smoke(st: CheckSettings) -> dict[str, Any]:
    """World size 1 (NCCL on a GPU) inside ``run_single``: the same guarded loop, syncs counted,
    and the plain DDP loop's syncs for comparison."""
    import torch.distributed as dist

    device = torch.device(st.device, 0) if st.device == "cuda" else torch.device("cpu")
    out = one_run(0, "node0", st, device, steps=6, verify_every=3, count_syncs=True)
    out["backend"] = dist.get_backend()
    _, ddp, opt = build(st, device)
    counter = SyncCounter(device)
    plain: list[int | None] = []
    for s in range(3):
        with counter.count(plain):
            opt.zero_grad(set_to_none=True)
            lm_loss(ddp, batch_on(st, s, 0, device)).backward()
            opt.step()
    out["syncs_plain"] = plain
    return out
