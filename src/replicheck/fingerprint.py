"""Fingerprints of tensors: exact 64-bit digests and tolerant sketches.

Both stream over the tensor's memory once or twice on its own device, without a full-size
temporary, and return tensors (no host synchronisation) so many can be gathered in one
collective.

* :func:`digest` — the raw bits viewed as 64-bit words, summed in rows of 16 words; the row
  sums and the column sums are weighted by position (so a swap of two values shows), and mixed
  with the element count. Two tensors with equal bits always have equal digests; a change of any
  single bit always changes it.
* :func:`sketch` — the L2 norm and ``k`` projections on ±1 sign vectors built as the outer
  product of a seeded row-sign and column-sign matrix (nothing of the tensor's size is stored).
  Compared with :func:`sketch_distance`, which scales every difference by the tensor's norm.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from replicheck import fused_digest as fd


def digest(t: torch.Tensor | None, *, fold_zero: bool = False) -> torch.Tensor:
    """Exact, position-weighted 64-bit digest of ``t``'s bits as a 0-dim int64 tensor on its device.

    ``None`` (an unused parameter's gradient) has its own constant digest. ``fold_zero`` maps
    -0.0 to +0.0 first (one temporary the size of ``t``), for values produced by different code
    paths that may differ only in the sign of zero.
    """
    return digests([t], fold_zero=fold_zero)[0]


def digests(tensors: Sequence[torch.Tensor | None], *, fold_zero: bool = False) -> torch.Tensor:
    """Per-tensor :func:`digest` values as a 1-D int64 tensor on the tensors' device.

    Fused: small tensors are digested together and large ones reduced in two streaming reads
    each, so a model of hundreds of tensors costs a few kernels per large tensor and no host
    transfer (see :mod:`replicheck.fused_digest`).
    """
    return fd.digests(tensors, fold_zero=fold_zero)


def combine(values: torch.Tensor) -> torch.Tensor:
    """Fold a 1-D int64 tensor of digests into one position-weighted 0-dim digest."""
    return fd.combine(values)


def tensor_digest(t: torch.Tensor | None, *, fold_zero: bool = False) -> int:
    """:func:`digest` as a Python int (synchronises with the device)."""
    return int(digest(t, fold_zero=fold_zero).item())


_SKETCH_COLS = 256


def _signs(gen: torch.Generator, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen, dtype=torch.int8).to(dtype).mul_(2).sub_(1)


def sketch(t: torch.Tensor | None, *, seed: int, k: int = 4) -> torch.Tensor:
    """Norm and ``k`` ±1 projections of ``t`` as a float64 tensor of ``k + 1`` values (on CPU).

    The sign vector of projection ``j`` is ``row_sign[:, j] ⊗ col_sign[:, j]`` over the tensor
    viewed as rows of 256 values, both drawn from ``seed``: the tensor is read once (one
    matrix-vector product per block) and nothing of its size is stored.
    """
    if t is None:
        return torch.zeros(k + 1, dtype=torch.float64)
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float32)
    compute = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    n = flat.numel()
    m = n // _SKETCH_COLS
    out = torch.zeros(k + 1, dtype=torch.float64)
    out[0] = torch.linalg.vector_norm(flat, dtype=compute).double().cpu()
    proj = torch.zeros(k, dtype=torch.float64)
    col = _signs(gen, (_SKETCH_COLS, k), compute).to(flat.device)
    if m:
        row = _signs(gen, (m, k), compute).to(flat.device)
        block = flat[: m * _SKETCH_COLS].view(m, _SKETCH_COLS)
        if block.dtype != compute:
            block = block.to(compute)
        proj += ((block @ col) * row).sum(dim=0).double().cpu()
    if n > m * _SKETCH_COLS:
        tail = flat[m * _SKETCH_COLS :].to(compute)
        proj += (tail @ col[: tail.numel()]).double().cpu()
    out[1:] = proj
    return out


def sketches(tensors: Sequence[torch.Tensor | None], *, seed: int, k: int = 4) -> torch.Tensor:
    """Per-tensor sketches as a float64 tensor of shape ``(len(tensors), k + 1)``."""
    if not tensors:
        return torch.zeros(0, k + 1, dtype=torch.float64)
    return torch.stack([sketch(t, seed=seed * 1_000_003 + i, k=k) for i, t in enumerate(tensors)])


def sketch_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-tensor distance of two sketch matrices, each difference scaled by the tensor's norm.

    A single projection can cancel to near zero, so its difference is divided by the norm (the
    scale of its noise), never by the projection itself. Returns a float64 tensor of one value
    per tensor; NaN or Inf in either sketch gives ``inf``.
    """
    scale = torch.maximum(a[:, 0].abs(), b[:, 0].abs()).clamp_min(1e-30)
    diff = (a - b).abs().amax(dim=1) / scale
    bad = ~(torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1))
    both_zero = (a.abs().amax(dim=1) == 0) & (b.abs().amax(dim=1) == 0)
    diff = torch.where(both_zero, torch.zeros_like(diff), diff)
    return torch.where(bad, torch.full_like(diff, float("inf")), diff)


# -- digests of training state: one definition for the guard, the checkpoint store, the harness --

Weights = Literal["trainable", "all", "replicated"]
"""Which tensors a weights digest covers: the parameters with ``requires_grad`` (what the
optimizer updates), every parameter (what a checkpoint's manifest fingerprints), or
``replicated``: every parameter, frozen ones included, plus every buffer that data-parallel
replicas hold identically (what the guard compares across replicas, so a changed frozen base
weight of a LoRA model or a changed constant buffer is seen)."""

_WHICH = ("trainable", "all", "replicated")


def named_weights(module: torch.nn.Module, which: Weights) -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s parameters covered by a ``which`` digest, in ``named_parameters()`` order."""
    if which not in _WHICH:
        raise ValueError(f"which must be one of {', '.join(_WHICH)}, got {which!r}")
    return [(n, p) for n, p in module.named_parameters() if which != "trainable" or p.requires_grad]


def named_state(
    module: torch.nn.Module, which: Weights, *, per_rank: Collection[str] = ()
) -> list[tuple[str, torch.Tensor]]:
    """The tensors a ``which`` digest covers: :func:`named_weights`, then (for ``replicated``)
    the buffers replicas share, in ``named_buffers()`` order.

    Running statistics of normalisation layers are left out: each rank updates them from its own
    batch in forward (DDP re-broadcasts rank 0's only at the next forward), so replicas differ
    there by design, and so are the buffers named in ``per_rank``.
    """
    named: list[tuple[str, torch.Tensor]] = list(named_weights(module, which))
    if which == "replicated":
        skip = {
            id(b)
            for m in module.modules()
            if isinstance(m, (torch.nn.modules.batchnorm._NormBase))
            for b in m.buffers(recurse=False)
        }
        named += [(n, b) for n, b in module.named_buffers() if id(b) not in skip and n not in per_rank]
    return named


def weights_digest(tensors: Iterable[torch.Tensor | None]) -> int:
    """One position-weighted digest of a sequence of tensors (weights, in a fixed order).

    Equals ``int(combine(digests(tensors)))``; one host synchronisation.
    """
    return int(weights_digest_tensor(tensors).item())


def weights_digest_tensor(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """:func:`weights_digest` as a 0-dim int64 tensor on the tensors' device (no host transfer)."""
    return fd.combined(list(tensors))


def model_digest(module: torch.nn.Module, which: Weights, *, per_rank: Collection[str] = ()) -> int:
    """:func:`weights_digest` of the tensors :func:`named_state` selects."""
    return int(model_digest_tensor(module, which, per_rank=per_rank).item())


def model_digest_tensor(
    module: torch.nn.Module, which: Weights, *, per_rank: Collection[str] = ()
) -> torch.Tensor:
    """:func:`model_digest` as a 0-dim int64 tensor on the module's device (no host transfer)."""
    return weights_digest_tensor(t for _, t in named_state(module, which, per_rank=per_rank))


OptimizerState = Mapping[Any, Mapping[str, Any]]
"""An optimizer's ``state_dict()["state"]``: per-parameter state keyed by parameter index."""


def optimizer_digest(source: torch.optim.Optimizer | OptimizerState) -> int:
    """Digest of optimizer state: parameters in order, each one's tensors by sorted key.

    ``source`` is a live optimizer (parameters in ``param_groups`` order) or a state dict's
    ``"state"`` (parameter indices in order, which number ``param_groups`` the same way), so a
    live optimizer and its saved state digest alike.
    """
    return int(optimizer_digest_tensor(source).item())


def optimizer_digest_tensor(source: torch.optim.Optimizer | OptimizerState) -> torch.Tensor:
    """:func:`optimizer_digest` as a 0-dim int64 tensor on the state's device (no host transfer;
    CPU-resident step counters are folded in as host numbers)."""
    if isinstance(source, torch.optim.Optimizer):
        entries: list[Any] = [source.state.get(p, {}) for g in source.param_groups for p in g["params"]]
    else:
        entries = [source[i] for i in sorted(source, key=lambda k: (str(type(k)), k))]
    tensors: list[torch.Tensor | None] = []
    for entry in entries:
        if isinstance(entry, Mapping):
            tensors.extend(entry[k] for k in sorted(entry, key=str) if isinstance(entry[k], torch.Tensor))
    return weights_digest_tensor(tensors)
