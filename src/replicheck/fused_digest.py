"""Exact digests of many tensors in a few fused passes, on their own device.

The digest of one tensor (see :mod:`replicheck.fingerprint`) is linear in its words modulo
2**64: with its ``n`` words ``x`` viewed as ``m`` rows of 16 and a tail,

    d = n*K_TAIL + sum_rc (w_r + v_c) * x_rc + sum_j w_j*K_TAIL * tail_j

where ``w_r`` are odd row weights and ``v_c`` even column weights. So the digests of a whole
list are computed as:

* a tensor of more than ``_SMALL_WORDS`` words is reduced on its own to its weighted row term
  and its 16 column sums (two streaming reads; the row sums are 1/16 of the tensor), which enter
  the fused stage with coefficients 1 and ``v_c``;
* a smaller tensor contributes its words directly, with coefficients ``w_r + v_c``;
* everything is concatenated per chunk of at most ``_CHUNK_WORDS`` words, multiplied by a
  coefficient vector cached per layout, and summed per tensor with one cumulative sum.

Nothing leaves the device, no host tensor is created on a cached layout, and the values are the
same as the per-tensor definition, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROW = 16
# Odd 64-bit multipliers (golden-ratio and splitmix constants) spread positions over the word.
K_ROW = -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64
K_COL = 3394490528163516939  # 0xBF58476D1CE4E5B9 >> 1, doubled where used
K_TAIL = -7723592293110705685  # 0x94D049BB133111EB
NONE_DIGEST = 0x5EED_0000_0000_0001
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SMALL_WORDS = 1 << 10
"""Tensors up to this many words enter the fused stage as they are (no per-tensor kernel)."""
_CHUNK_WORDS = 1 << 20
"""Words of the fused stage processed at once (8 MiB of int64; bounds the temporaries)."""
_CACHE_LIMIT = 64


def wrap(v: int) -> int:
    """``v`` reduced to a signed 64-bit value (the arithmetic the digests use)."""
    v &= 0xFFFF_FFFF_FFFF_FFFF
    return v - (1 << 64) if v >= 1 << 63 else v


_weight_cache: dict[tuple[int, torch.device], torch.Tensor] = {}


def row_weights(m: int, device: torch.device) -> torch.Tensor:
    """The odd position weights ``w_1..w_m`` (cached per length and device)."""
    key = (m, device)
    w = _weight_cache.get(key)
    if w is None:
        if len(_weight_cache) > 256:
            _weight_cache.clear()
        w = (torch.arange(1, m + 1, dtype=torch.int64, device=device) * K_ROW) | 1
        _weight_cache[key] = w
    return w


def _ints(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer tensor of its element size, starting on a word (a view
    that starts inside a 64-bit word is copied first, so it digests as its clone does)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        # Real and imaginary parts as consecutive values (complex128 is 16 bytes: no int of that size).
        flat = torch.view_as_real(flat).reshape(-1)
    size = flat.element_size()
    ints = flat.view(_INT_OF_SIZE[size]) if flat.dtype.is_floating_point or size != 8 else flat
    if ints.storage_offset() % (8 // size):
        ints = ints.clone()
    return ints


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer tensor (int64 words where the layout allows)."""
    ints = _ints(t)
    per_word = 8 // ints.element_size()
    if per_word > 1 and ints.numel() % per_word == 0:
        return ints.view(torch.int64)
    return ints


def row_digest(t: torch.Tensor) -> torch.Tensor:
    """A cheaper exact digest for comparing one tensor across ranks within a step (never stored):
    the words' sums in rows of 16, weighted by odd row weights, plus the tail. One streaming read
    instead of :func:`digests`' two. A change of any single word always changes it (an odd weight
    times a non-zero difference is non-zero modulo 2**64); a change that moves values between the
    words of one row and keeps their sum does not (the full digest's column term sees that)."""
    ints = _ints(t)
    device = ints.device
    per_word = 8 // ints.element_size()
    whole = ints.numel() // per_word * per_word
    w = ints[:whole].view(torch.int64) if per_word > 1 else ints
    m = w.numel() // ROW
    total = torch.full((), wrap(ints.numel() * K_TAIL), dtype=torch.int64, device=device)
    if m:
        rows = w[: m * ROW].view(m, ROW).sum(dim=1, dtype=torch.int64)
        total = total + rows.mul_(row_weights(m, device)).sum()
    tail = torch.cat([w[m * ROW :], ints[whole:].to(torch.int64)])
    if tail.numel():
        total = total + (tail * (row_weights(tail.numel(), device) * K_TAIL)).sum()
    return total


def _foldable(t: torch.Tensor | None) -> bool:
    return t is not None and (t.is_floating_point() or t.is_complex())


def fold_zeros(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """-0.0 mapped to +0.0 (``x + 0.0``) in every small floating tensor, in one foreach call;
    large ones are folded one by one in :func:`_values`, right before they are read."""
    idx = [i for i, t in enumerate(tensors) if _foldable(t) and t.numel() <= _SMALL_WORDS]  # type: ignore[union-attr]
    out = list(tensors)
    if idx:
        folded = torch._foreach_add([tensors[i].detach() for i in idx], 0.0)  # type: ignore[union-attr]
        for i, f in zip(idx, folded):
            out[i] = f
    return out


@dataclass(frozen=True)
class _Layout:
    """Coefficients and segment bounds of one chunk, cached per shape of its inputs."""

    coef: torch.Tensor
    """int64 coefficient of every value of the chunk, after one leading zero."""
    bounds: torch.Tensor
    """int64 offsets into the cumulative sum: tensor ``i`` sums ``(bounds[i], bounds[i+1]]``."""
    const: torch.Tensor
    """int64 constant term of every tensor (``n*K_TAIL``, or the digest of ``None``)."""


_layouts: dict[tuple[object, ...], _Layout] = {}

# Per tensor: ("none",), ("words", n) or ("rc", n) — the key of its part of a layout.
_Part = tuple[str, int]


def _coef(part: _Part, device: torch.device) -> torch.Tensor:
    kind, n = part
    m, tail = divmod(n, ROW)
    col = row_weights(ROW, device) * (2 * K_COL)  # even: bit 63 cannot cancel between terms
    tail_coef = row_weights(tail, device) * K_TAIL
    if kind == "words":
        grid = (row_weights(m, device).view(m, 1) + col.view(1, ROW)).reshape(-1)
        return torch.cat([grid, tail_coef])
    if kind == "rc":
        return torch.cat([torch.ones(1, dtype=torch.int64, device=device), col, tail_coef])
    return torch.zeros(0, dtype=torch.int64, device=device)


def _layout(parts: Sequence[_Part], device: torch.device) -> _Layout:
    key = (device, tuple(parts))
    got = _layouts.get(key)
    if got is not None:
        return got
    if len(_layouts) >= _CACHE_LIMIT:
        _layouts.clear()
    pieces = [torch.zeros(1, dtype=torch.int64, device=device)] + [_coef(p, device) for p in parts]
    offsets = [0]
    for p in pieces[1:]:
        offsets.append(offsets[-1] + p.numel())
    consts = [NONE_DIGEST if kind == "none" else wrap(n * K_TAIL) for kind, n in parts]
    got = _Layout(
        coef=torch.cat(pieces),
        bounds=torch.tensor(offsets, dtype=torch.int64, device=device),
        const=torch.tensor(consts, dtype=torch.int64, device=device),
    )
    _layouts[key] = got
    return got


def _values(t: torch.Tensor | None, fold_zero: bool) -> tuple[_Part, list[torch.Tensor]]:
    """A tensor's part of the fused stage: its key and the int64 values it contributes."""
    if t is None:
        return ("none", 0), []
    if fold_zero and _foldable(t) and t.numel() > _SMALL_WORDS:
        t = t.detach() + 0.0  # -0.0 + 0.0 == +0.0; every other value unchanged
    w = words(t)
    n = w.numel()
    if n <= _SMALL_WORDS:
        return ("words", n), [w if w.dtype == torch.int64 else w.to(torch.int64)]
    m = n // ROW
    block = w[: m * ROW].view(m, ROW)
    # The row term is weighted here (1/16 of the tensor); the stage gets it as one value.
    rows = block.sum(dim=1, dtype=torch.int64).mul_(row_weights(m, w.device)).sum().view(1)
    vals = [rows, block.sum(dim=0, dtype=torch.int64)]
    if n > m * ROW:
        vals.append(w[m * ROW :].to(torch.int64))
    return ("rc", n), vals


def _chunk(items: Sequence[tuple[_Part, list[torch.Tensor]]], device: torch.device) -> torch.Tensor:
    layout = _layout([p for p, _ in items], device)
    flat = torch.cat([layout.coef[:1]] + [v for _, vals in items for v in vals])
    sums = torch.cumsum(flat.mul_(layout.coef), 0)
    return sums[layout.bounds[1:]] - sums[layout.bounds[:-1]] + layout.const


def _on_device(
    tensors: Sequence[torch.Tensor | None], device: torch.device, fold_zero: bool = False
) -> torch.Tensor:
    """Digests of tensors that all live on ``device`` (``None`` allowed); ``fold_zero``: the
    small ones are already folded, the large ones are folded here."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    out: list[torch.Tensor] = []
    items: list[tuple[_Part, list[torch.Tensor]]] = []
    size = 0
    for t in tensors:
        part, vals = _values(t, fold_zero)
        n = sum(v.numel() for v in vals)
        if items and size + n > _CHUNK_WORDS:
            out.append(_chunk(items, device))
            items, size = [], 0
        items.append((part, vals))
        size += n
    if items:
        out.append(_chunk(items, device))
    return out[0] if len(out) == 1 else torch.cat(out)


_index_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _index(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    """An index tensor on ``device``, copied there once per distinct index list."""
    key = (device, tuple(idx))
    got = _index_cache.get(key)
    if got is None:
        if len(_index_cache) >= _CACHE_LIMIT:
            _index_cache.clear()
        got = _index_cache[key] = torch.tensor(list(idx), dtype=torch.int64, device=device)
    return got


def _groups(items: Sequence[torch.Tensor | None]) -> tuple[torch.device, dict[torch.device, list[int]]]:
    """The result's device (the first accelerator, else the first device) and the indices per
    device (``None`` entries go with the result's device)."""
    devices = [t.device for t in items if t is not None]
    target = next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))
    groups: dict[torch.device, list[int]] = {target: []}
    for i, t in enumerate(items):
        groups.setdefault(target if t is None else t.device, []).append(i)
    return target, groups


def digests(tensors: Sequence[torch.Tensor | None], *, fold_zero: bool = False) -> torch.Tensor:
    """Per-tensor digests as a 1-D int64 tensor on the tensors' device (no host transfer).

    With tensors on several devices the result lives on the first accelerator among them (the
    other parts are copied there; :func:`combined` avoids that for CPU-resident parts).
    """
    items = fold_zeros(tensors) if fold_zero else list(tensors)
    target, groups = _groups(items)
    if len(groups) == 1:
        return _on_device(items, target, fold_zero)
    out = torch.empty(len(items), dtype=torch.int64, device=target)
    for dev, idx in groups.items():
        if idx:
            out[_index(idx, target)] = _on_device([items[i] for i in idx], dev, fold_zero).to(target)
    return out


def combine(values: torch.Tensor) -> torch.Tensor:
    """Fold a 1-D int64 tensor of digests into one position-weighted 0-dim digest (same device)."""
    if values.numel() == 0:
        return values.new_zeros((), dtype=torch.int64)
    return (values * row_weights(values.numel(), values.device)).sum()


def combined(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``combine(digests(tensors))`` as a 0-dim tensor on the first accelerator among them.

    A part on the CPU (an optimizer's step counters next to device state) is folded in as a host
    number, so nothing waits for the device.
    """
    items = list(tensors)
    target, groups = _groups(items)
    if len(groups) == 1:
        return combine(_on_device(items, target))
    total = torch.zeros((), dtype=torch.int64, device=target)
    for dev, idx in groups.items():
        if not idx:
            continue
        part = _on_device([items[i] for i in idx], dev)
        weighted = (part * row_weights(len(items), dev)[_index(idx, dev)]).sum()
        if dev.type == "cpu" and target.type != "cpu":
            total = total + int(weighted)  # a host number: no device synchronisation
        else:
            total = total + weighted.to(target)
    return total
