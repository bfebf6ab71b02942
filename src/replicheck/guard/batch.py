"""Batches as pytrees of tensors whose dimension 0 is the sample dimension."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.utils import _pytree as pytree

from replicheck.guard.errors import BatchError


def batch_size(batch: Any) -> int:
    """The shared size of dimension 0 of every tensor leaf of ``batch``."""
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise BatchError("a batch must contain at least one tensor")
    dims = [int(x.shape[0]) if x.dim() else None for x in leaves]
    sizes = set(dims)
    first = dims[0]
    if len(sizes) != 1 or first is None:
        raise BatchError(f"every tensor in a batch needs the same dimension 0, got {sorted(map(str, sizes))}")
    return first


def split(batch: Any, n: int) -> tuple[Any, Any]:
    """``(first n samples, the rest)`` of ``batch``; non-tensor leaves are kept in both."""

    def head(x: Any) -> Any:
        return x[:n] if isinstance(x, torch.Tensor) else x

    def tail(x: Any) -> Any:
        return x[n:] if isinstance(x, torch.Tensor) else x

    return pytree.tree_map(head, batch), pytree.tree_map(tail, batch)


def to_device(batch: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def pack(obj: Any) -> torch.Tensor:
    """Serialise ``obj`` (tensors moved to CPU) into a uint8 tensor for point-to-point sends."""
    cpu = pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, obj)
    buf = io.BytesIO()
    torch.save(cpu, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor) -> Any:
    # weights_only: a probe payload holds tensors, numbers, strings and containers only.
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
