"""Batches as pytrees of tensors whose dimension 0 is the sample dimension.

Containers: dicts, lists, tuples, named tuples and dataclass instances (the last are not torch
pytree nodes, so they are walked here field by field).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from replicheck.guard.errors import BatchError
from replicheck.guard.transport.transfer import to_host


def _is_record(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _rebuilt(obj: Any, values: dict[str, object]) -> Any:
    """A copy of dataclass instance ``obj`` with its fields set to ``values`` (no __init__ rerun)."""
    out = object.__new__(type(obj))
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def tree_map(fn: Callable[[Any], Any], batch: Any) -> Any:
    """``fn`` applied to every leaf of ``batch``, containers (dataclasses included) kept."""

    def leaf(x: Any) -> Any:
        if _is_record(x):
            return _rebuilt(x, {f.name: tree_map(fn, getattr(x, f.name)) for f in dataclasses.fields(x)})
        return fn(x)

    return pytree.tree_map(leaf, batch, is_leaf=_is_record)


def tree_leaves(batch: Any) -> list[Any]:
    """The leaves of ``batch`` in order, dataclass fields included."""
    out: list[Any] = []
    tree_map(out.append, batch)
    return out


def batch_size(batch: Any) -> int:
    """The shared size of dimension 0 of every tensor leaf of ``batch``."""
    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]
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

    return tree_map(head, batch), tree_map(tail, batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor leaf on ``device``, containers (records included) kept.

    A tensor already there is kept as is; a pinned host tensor is copied asynchronously (the copy
    is ordered on the current stream before any kernel that reads it).
    """

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.device == device:
            return x
        pinned = x.device.type == "cpu" and device.type != "cpu" and x.is_pinned()
        return x.to(device, non_blocking=pinned)

    return tree_map(move, batch)


# Named tuples and dataclasses cross ranks as tagged tuples of their fields: torch.load with
# weights_only=True (no arbitrary code from another process) cannot rebuild user classes.
_RECORD_TAG = "replicheck.record/1"
_TENSOR_TAG = "replicheck.tensor/1"
_ALIGN = 16
"""Byte alignment of each tensor in a packed message (any dtype can be viewed in place)."""


def _to_wire(x: Any, tensors: list[torch.Tensor]) -> Any:
    """``x`` with each tensor replaced by its place in ``tensors`` and records made plain."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return (_TENSOR_TAG, len(tensors) - 1)
    if _is_record(x) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        names = [f.name for f in dataclasses.fields(x)] if _is_record(x) else list(x._fields)
        cls = type(x)
        return (
            _RECORD_TAG,
            cls.__module__,
            cls.__qualname__,
            {n: _to_wire(getattr(x, n), tensors) for n in names},
        )
    if isinstance(x, dict):
        return {k: _to_wire(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_wire(v, tensors) for v in x)
    return x


def _record_class(module: str, qualname: str) -> type:
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise BatchError(
            f"a batch of type {module}.{qualname} cannot be rebuilt on this rank: {exc}"
        ) from None
    if not isinstance(obj, type) or not (
        dataclasses.is_dataclass(obj) or (issubclass(obj, tuple) and hasattr(obj, "_fields"))
    ):
        raise BatchError(f"{module}.{qualname} is not a named tuple or dataclass")
    return obj


def _from_wire(x: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _TENSOR_TAG:
        return tensors[x[1]]
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _RECORD_TAG:
        cls = _record_class(x[1], x[2])
        fields = {k: _from_wire(v, tensors) for k, v in x[3].items()}
        if dataclasses.is_dataclass(cls):
            return _rebuilt(object.__new__(cls), fields)
        return cls(**fields)
    if isinstance(x, dict):
        return {k: _from_wire(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_from_wire(v, tensors) for v in x)
    return x


def pack(obj: Any) -> torch.Tensor:
    """Serialise ``obj`` into one uint8 tensor for point-to-point sends.

    Layout: the header's length (8 bytes), the header (``obj`` with each tensor replaced by its
    index, and each tensor's dtype, shape and place, as ``torch.save`` data), then every tensor's
    bytes, each aligned to 16. The tensors are copied once, on their device when they share one,
    so a message of device tensors never crosses to the host.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _to_wire(obj, tensors)
    devices = {t.device for t in tensors}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    parts: list[torch.Tensor] = []
    layout: list[tuple[str, list[int], int, int]] = []
    offset = 0
    for t in tensors:
        t = t.detach() if t.device == device else to_host(t, "probe batch")
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        layout.append((str(t.dtype).removeprefix("torch."), list(t.shape), offset + pad, raw.numel()))
        parts.append(raw)
        offset += pad + raw.numel()
    buf = io.BytesIO()
    torch.save((skeleton, layout), buf)
    header = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    length = torch.tensor([header.numel()], dtype=torch.int64).view(torch.uint8)
    fill = torch.zeros(-(length.numel() + header.numel()) % _ALIGN, dtype=torch.uint8)
    # A new tensor that torch owns (no Python buffer behind it): a frombuffer tensor keeps a
    # Python object alive, and if the gloo worker thread that sent it drops the last reference
    # while the interpreter exits, taking the GIL there aborts the process.
    return torch.cat([torch.cat([length, header, fill]).to(device), *parts])


def unpack(data: torch.Tensor) -> Any:
    """The object :func:`pack` serialised, decoded on the host.

    The rule for every received message: ``data`` (on the communication device) crosses to the
    host in one counted transfer (``"received message"``), and each tensor of the object is a
    host tensor with its own allocation (a clone, storage offset 0: not a view into ``data``, so
    its alignment and lifetime are those of a tensor made here). Code that computes with a
    decoded tensor moves it to its compute device (:func:`to_device`).
    """
    host = to_host(data, "received message")
    n = int(host[:8].view(torch.int64)) if host.numel() >= 8 else -1
    if n < 0 or 8 + n > host.numel():
        raise BatchError(f"a packed message of {host.numel()} bytes is truncated (header of {n})")
    # weights_only: a message holds numbers, strings, containers and tensor places only.
    skeleton, layout = torch.load(io.BytesIO(host[8 : 8 + n].numpy().tobytes()), weights_only=True)
    base = 8 + n + (-(8 + n) % _ALIGN)
    tensors = []
    for dtype, shape, offset, nbytes in layout:
        if base + offset + nbytes > host.numel():
            raise BatchError(f"a packed message of {host.numel()} bytes is truncated (its tensors)")
        raw = host[base + offset : base + offset + nbytes]
        tensors.append(raw.view(getattr(torch, dtype)).view(shape).clone())
    return _from_wire(skeleton, tensors)
