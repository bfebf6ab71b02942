"""Fingerprints of tensors: exact 64-bit digests and tolerant sketches.

Both stream over the tensor's memory once or twice on its own device, without a full-size
temporary, and return tensors (no host synchronisation) so many can be gathered in one
collective.

* :func:`digest` — the raw bits viewed as 64-bit words, summed in rows of 16 words; the row
  sums and the column sums are weighted by position (so a swap of two values shows), and mixed
  with the element count. Two tensors with equal bits always have equal digests; a change of any
  single bit always changes it.
* :func:`sketch` — per block of consecutive values, the L2 norm and ``k`` projections on ±1
  sign vectors hashed on the device from a seed (nothing of the tensor's size is stored).
  Compared with :func:`sketch_distance`, which scales every difference by its block's norm.
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


def row_digest(t: torch.Tensor) -> torch.Tensor:
    """A one-read exact digest for comparing a tensor across ranks within one step, as a 0-dim
    int64 tensor on its device; cheaper than :func:`digest` and not equal to it (never store it).
    Any single changed word changes it; see :func:`replicheck.fused_digest.row_digest`."""
    return fd.row_digest(t)


def combine(values: torch.Tensor) -> torch.Tensor:
    """Fold a 1-D int64 tensor of digests into one position-weighted 0-dim digest."""
    return fd.combine(values)


def tensor_digest(t: torch.Tensor | None, *, fold_zero: bool = False) -> int:
    """:func:`digest` as a Python int (synchronises with the device)."""
    return int(digest(t, fold_zero=fold_zero).item())


SKETCH_BLOCK = 4096
"""Default values per block of a tolerant sketch (see :func:`sketch`)."""
_SKETCH_META = 2  # leading columns of a sketch row: tensor index, values in the block
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15: golden-ratio multiplier (splitmix64)
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_sign_base: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _mix(h: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; ``>>`` is arithmetic on int64, so the
    high bits are masked to make each shift logical)."""
    h = h ^ ((h >> 30) & 0x3_FFFF_FFFF)
    h = h * _M2
    h = h ^ ((h >> 27) & 0x1F_FFFF_FFFF)
    h = h * _M3
    return h ^ ((h >> 31) & 0x1_FFFF_FFFF)


def _signs(block: int, k: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``block × k`` ±1 signs, a hash of (position, projection, seed) computed on ``device``.

    The position part is cached per shape and device; each call mixes in its seed with a few
    elementwise operations on ``block × k`` values (nothing of the tensor's size, nothing from
    the host but the seed).
    """
    key = (block, k, device)
    base = _sign_base.get(key)
    if base is None:
        if len(_sign_base) > 64:
            _sign_base.clear()
        idx = torch.arange(1, block * k + 1, dtype=torch.int64, device=device).view(block, k)
        base = _mix(idx * _M1)
        _sign_base[key] = base
    h = _mix(base ^ fd.wrap(seed * _M1 + _M3))
    return ((h >> 62) & 2).to(dtype) - 1


def sign_matrix(block: int, k: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The ``block × k`` ±1 matrix the sketches project with (the same on every rank and device
    for the same arguments)."""
    return _signs(block, k, seed, device, dtype)


def _sketch_rows(t: torch.Tensor | None, index: int, seed: int, k: int, block: int) -> torch.Tensor:
    """Rows ``[index, values, norm, projection × k]`` of each block of ``t`` (float64, on its device)."""
    if t is None:
        row = torch.zeros(1, _SKETCH_META + 1 + k, dtype=torch.float64)
        row[0, 0] = index
        return row
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float32)
    compute = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
    n = flat.numel()
    m, tail = divmod(n, block)
    width = block if m else tail
    signs = _signs(max(width, 1), k, seed, flat.device, compute)
    parts: list[torch.Tensor] = []
    if m:
        body = flat[: m * block].view(m, block)
        if body.dtype != compute:
            body = body.to(compute)
        norms = torch.linalg.vector_norm(body, dim=1, dtype=compute)
        parts.append(torch.cat([norms.unsqueeze(1), body @ signs], dim=1))
    if tail or not n:
        rest = flat[m * block :].to(compute)
        norm = torch.linalg.vector_norm(rest, dtype=compute).reshape(1, 1)
        parts.append(torch.cat([norm, (rest @ signs[: rest.numel()]).reshape(1, k)], dim=1))
    body_rows = torch.cat(parts).double()
    # Built on the device (no host data): the tensor's index, then the values in each block.
    meta = torch.full(
        (body_rows.shape[0], _SKETCH_META), float(index), dtype=torch.float64, device=body_rows.device
    )
    meta[:, 1] = block
    if tail or not n:
        meta[-1, 1] = tail
    return torch.cat([meta, body_rows], dim=1)


def sketch_rows(t: torch.Tensor, *, index: int, seed: int, k: int, block: int = SKETCH_BLOCK) -> torch.Tensor:
    """The rows :func:`sketches` gives ``t`` at position ``index`` of its list, left on ``t``'s
    device (one tensor at a time, as a sharded model's gradients appear)."""
    return _sketch_rows(t, index, seed * 1_000_003 + index, k, _check_block(block))


def sketch(t: torch.Tensor | None, *, seed: int, k: int = 4, block: int = SKETCH_BLOCK) -> torch.Tensor:
    """Per-block sketch of ``t``: a float64 ``(blocks, k + 3)`` tensor on CPU.

    ``t`` is cut into blocks of ``block`` consecutive values (the last one may be shorter); each
    block's row is ``[0, values in the block, L2 norm, k projections]``, a projection being the
    block's dot product with a ±1 sign vector hashed from ``seed`` on the tensor's device. The
    tensor is read once for the norms and once for the projections (one matrix product); a
    ``None`` gradient has one all-zero row. A sparse change stays large against its own block's
    norm instead of being diluted by the whole tensor's.
    """
    return _sketch_rows(t, 0, seed, k, _check_block(block)).cpu()


def sketches(
    tensors: Sequence[torch.Tensor | None], *, seed: int, k: int = 4, block: int = SKETCH_BLOCK
) -> torch.Tensor:
    """The blocks of every tensor, one :func:`sketch` after another (column 0 is the tensor's
    index in ``tensors``), as one float64 CPU tensor: one host transfer for the whole list."""
    if not tensors:
        return torch.zeros(0, _SKETCH_META + 1 + k, dtype=torch.float64)
    block = _check_block(block)
    rows = [_sketch_rows(t, i, seed * 1_000_003 + i, k, block) for i, t in enumerate(tensors)]
    device = next((r.device for r in rows if r.device.type != "cpu"), torch.device("cpu"))
    return torch.cat([r.to(device) for r in rows]).cpu()


def _check_block(block: int) -> int:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return block


def _tensor_count(s: torch.Tensor) -> int:
    """Tensors a sketch covers, or -1 when it is not a well-formed sketch."""
    if s.dim() != 2 or s.shape[1] <= _SKETCH_META + 1 or s.dtype != torch.float64:
        return -1
    if not s.shape[0]:
        return 0
    index = s[:, 0]
    if not bool(torch.isfinite(index).all()) or bool((index < 0).any()) or index.max() >= s.shape[0]:
        return -1
    return int(index.max()) + 1


def sketch_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-tensor distance of two :func:`sketches` of the same tensors: the largest over the
    tensor's blocks of the block's largest norm or projection difference, scaled by the block's
    norm — floored at the block's fair share of the tensor's norm, ``‖t‖·√(values/numel)``, so a
    block whose values nearly cancel does not turn rounding noise into an alarm.

    Returns one float64 value per tensor; NaN or Inf in a tensor's blocks gives ``inf``, and so
    does every tensor when the two sketches do not have the same layout (a peer's malformed
    fingerprint is a disagreement, not a crash).
    """
    count = max(_tensor_count(a), _tensor_count(b))
    if count < 0 or a.shape != b.shape or not torch.equal(a[:, :_SKETCH_META], b[:, :_SKETCH_META]):
        return torch.full((max(count, 1),), float("inf"), dtype=torch.float64)
    index = a[:, 0].long()
    values = a[:, 1]
    va, vb = a[:, _SKETCH_META:], b[:, _SKETCH_META:]
    na, nb = va[:, 0].abs(), vb[:, 0].abs()
    sq = torch.zeros(count, dtype=torch.float64)
    sq = sq.index_add(0, index, torch.maximum(na, nb).nan_to_num(0.0, 0.0, 0.0).square())
    numel = torch.zeros(count, dtype=torch.float64).index_add(0, index, values)
    share = (sq / numel.clamp_min(1)).sqrt()[index] * values.sqrt()
    scale = torch.maximum(torch.maximum(na, nb), share).clamp_min(1e-30)
    diff = (va - vb).abs().amax(dim=1) / scale
    both_zero = (va.abs().amax(dim=1) == 0) & (vb.abs().amax(dim=1) == 0)
    diff = torch.where(both_zero, torch.zeros_like(diff), diff)
    bad = ~(torch.isfinite(va).all(dim=1) & torch.isfinite(vb).all(dim=1))
    diff = torch.where(bad, torch.full_like(diff, float("inf")), diff)
    out = torch.zeros(count, dtype=torch.float64)
    return out.scatter_reduce(0, index, diff, reduce="amax", include_self=True)


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
