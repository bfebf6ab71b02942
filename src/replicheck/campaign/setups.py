"""What a campaign row installs or builds on each rank besides the fault: a poisoned sample, and
the setups the guard refuses at construction."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.campaign.scenarios import Refused
from replicheck.guard import Guard, GuardConfig, GuardConfigError, current_step
from replicheck.guard.modules import unwrap
from replicheck.harness.jobs import JobSpec
from replicheck.harness.launch import RankContext
from replicheck.harness.workloads import lm_loss, make_model


def install_poison(model: torch.nn.Module, step: int, tokens: torch.Tensor) -> None:
    """From now on, any forward at ``step`` of a sequence equal to ``tokens`` gives inf embeddings
    for it, on whichever rank runs it (a training pass, a probe, or a re-run for another rank)."""
    embed = unwrap(model).get_submodule("embed")

    def hook(_m: torch.nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if current_step() != step:
            return None
        seqs = inputs[0]
        hit = (seqs == tokens.to(seqs.device)).all(dim=-1)
        if not bool(hit.any()):
            return None
        out = out.clone()
        out[hit] = float("inf")
        return out

    embed.register_forward_hook(hook)


class _SyncBNHead(nn.Module):
    """The campaign decoder with a SyncBatchNorm over its logits: a collective inside forward."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.bn: nn.Module = nn.Identity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.decoder(tokens)
        return self.bn(logits.transpose(1, 2)).transpose(1, 2)


def construct(ctx: RankContext, spec: JobSpec, setup: Refused) -> str:
    """Build the guarded job with ``setup`` on this rank: the guard's refusal message, or
    ``"accepted"`` when it constructed."""
    model: nn.Module = make_model(spec.model, seed=spec.seed)
    if setup == "sync_batchnorm":
        model = _SyncBNHead(model)
    ddp = DistributedDataParallel(model, static_graph=setup == "static_graph")
    if setup == "sync_batchnorm":
        # DDP itself refuses SyncBatchNorm on CPU modules, so on these CPU jobs the layer joins
        # after wrapping: what is under test is the guard's own check at its construction.
        ddp.module.bn = nn.SyncBatchNorm(spec.model.vocab)
    opt = torch.optim.AdamW(ddp.parameters(), lr=spec.lr)
    try:
        Guard(ddp, opt, lm_loss, config=spec.guard or GuardConfig(), node=ctx.node)
    except GuardConfigError as exc:
        return str(exc)
    return "accepted"
