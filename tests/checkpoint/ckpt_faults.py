"""Test-only fault hook for the checkpoint tests (a picklable ``JobSpec.setup``).

A plain forward hook, independent of ``replicheck.faults``: the checkpoint tests do not rely on
the injector being written alongside them.
"""

from __future__ import annotations

from typing import Any

import torch

from replicheck.guard import Guard, current_step
from replicheck.launch import RankContext


def forward_fault(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, onset: int) -> None:
    """Persistent fault: add 1.0 to one activation of block 0's feed-forward on ``rank`` from
    step ``onset`` on, in every pass (training, probe, replay), as bad hardware would."""
    if ctx.rank != rank:
        return

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if current_step() < onset:
            return None
        out = out.clone()
        out.view(-1)[7] += 1.0
        return out

    getattr(model, "module", model).blocks[0].ffn.register_forward_hook(hook)
