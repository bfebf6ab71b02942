"""The part of a tensor this rank holds, and digests over those parts (sharded state)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from replicheck import fingerprint as fp


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded with ``fully_shard`` (FSDP2 or HSDP)."""
    return isinstance(model, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def weights_digest(model: torch.nn.Module, per_rank: Sequence[str] = ()) -> torch.Tensor:
    """:func:`fingerprint.model_digest_tensor` of ``model``'s ``replicated`` state (the same
    tensors: normalisation statistics and ``per_rank`` buffers left out), over this rank's shards."""
    return fp.weights_digest_tensor(
        local(t.detach()) for _, t in fp.named_state(model, "replicated", per_rank=per_rank)
    )


def optimizer_digest(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """:func:`fingerprint.optimizer_digest_tensor` over this rank's shards of the optimizer state."""
    state = {
        i: {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    return fp.optimizer_digest_tensor(state)
