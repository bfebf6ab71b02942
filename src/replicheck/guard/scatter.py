"""Plain FSDP2: each reduce-scatter checked against the sum of what every rank put into it.

Under plain FSDP2 one rank alone holds each reduced gradient shard, so no replica can vote on
it. A sketch is linear (the sketch of a sum is the sum of the sketches), which gives a check
that needs no second copy of the shard: before the reduce-scatter every rank sketches each
destination chunk of its input, per block of ``block`` values (``k`` signed sums and the block's
L1 norm); a second reduce-scatter, of those sketches only (``(k + 1) / block`` of the gradient's
values: 1.2 % with the defaults), hands each rank the sketch its shard must have. The rank then sketches the collective's
output (*raw*) and its shard after the reduced-gradient hooks ran (*final*, what the optimizer
will read) and compares both with the expected sketch. Summation order differs between the two
sides, so the comparison allows the rounding of the reduction and of the sketches, bounded from
the blocks' L1 norms and the dtypes' epsilons (float32 sketches of float32 gradients: a change of
one value by more than ~6 % of its block's mean magnitude is seen; a flipped exponent or high
mantissa bit is, a flip of the last mantissa bits is not, as no tolerance can tell it from
rounding). A bfloat16 reduction rounds far more, and the bound grows with it.

A rank's verdict for the step (the worst over its reduce-scatters):

- ``OK``: every shard is the sum of the inputs.
- ``AFTER``: the collective delivered the right sum, the shard then changed on this rank alone
  (its hooks or its memory), so this rank is named.
- ``COLLECTIVE``: the collective's output differs from the sum of the inputs. The reduction runs
  through every rank's links and adders, so that evidence names no rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from replicheck import fingerprint as fp
from replicheck.guard.verdict import Finding

OK, AFTER, COLLECTIVE = 0, 1, 2
_NAMES = {OK: "ok", AFTER: "changed after the reduce-scatter", COLLECTIVE: "reduce-scatter output wrong"}
_SAFETY = 4.0
"""Margin over the rounding bound (itself a worst case: errors rarely all share a sign)."""


@dataclass(frozen=True, kw_only=True)
class _Pending:
    expected: torch.Tensor
    """``(blocks, k + 1)``: the sum over ranks of this shard's chunk sketches, and the L1 norms."""
    raw: torch.Tensor
    """``(blocks, k)``: the sketch of the collective's output."""
    rel_eps: float
    """Rounding bound per unit of L1 norm."""


class ScatterCheck:
    """One step's reduce-scatter checks on one rank (see the module docstring)."""

    def __init__(self, *, k: int = 2, block: int = 256, seed: int = 0x5CA7) -> None:
        self.k, self.block, self.seed = k, block, seed
        self.reset()

    def reset(self) -> None:
        """Start a step."""
        self._pending: list[_Pending] = []
        self._status: torch.Tensor | None = None
        self.calls = 0
        """Reduce-scatters checked this step."""

    def reduce(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
    ) -> None:
        """Reduce-scatter ``buffer`` into ``output`` (a sum or a mean, as FSDP asks), sketching
        both sides; the shard's final sketch is taken by :meth:`after_hooks`."""
        world = dist.get_world_size(group)
        mean = _is_avg(op)
        chunks = buffer.view(world, -1)
        local = self._rows(chunks, with_l1=True)  # (world, blocks, k + 1)
        dist.reduce_scatter_single(output, buffer, op=op, group=group)
        expected = torch.empty_like(local[0])
        # Flat on both sides: gloo checks only the first dimension.
        dist.reduce_scatter_single(expected.view(-1), local.reshape(-1), op=dist.ReduceOp.SUM, group=group)
        if mean:
            expected /= world
        compute = _compute_dtype(buffer.dtype)
        # Worst-case rounding per unit of L1 norm: the reduction (in the buffer's dtype), both
        # sides' sketches and the sum of the ranks' sketches (in ``compute``).
        eps = torch.finfo(compute).eps
        rel = (world - 1) * torch.finfo(buffer.dtype).eps + (2 * self.block + world - 1) * eps
        raw = self._rows(output.view(1, -1), with_l1=False)[0]
        self._pending.append(_Pending(expected=expected, raw=raw, rel_eps=_SAFETY * rel))
        self.calls += 1

    def after_hooks(self, shard: torch.Tensor) -> None:
        """The shard after the reduced-gradient hooks ran: judge the oldest pending reduce-scatter."""
        if not self._pending:
            return
        p = self._pending.pop(0)
        final = self._rows(shard.view(1, -1), with_l1=False)[0]
        bound = p.expected[:, self.k :] * p.rel_eps + torch.finfo(p.expected.dtype).tiny
        want = p.expected[:, : self.k]
        raw_bad = ((p.raw - want).abs() > bound).any() | ~torch.isfinite(p.raw).all()
        final_bad = ((final - want).abs() > bound).any() | ~torch.isfinite(final).all()
        # Only bad when the expected sketch itself is finite: a non-finite input is the gradient
        # health check's finding (named on the rank that produced it), not the reduction's.
        sane = torch.isfinite(p.expected).all()
        status = torch.where(raw_bad, COLLECTIVE, torch.where(final_bad, AFTER, OK)) * sane
        self._status = status if self._status is None else torch.maximum(self._status, status)

    def status(self) -> torch.Tensor | int:
        """This rank's verdict for the step (a 0-dim int64 device tensor; ``0`` when nothing ran)."""
        return 0 if self._status is None else self._status.to(torch.int64)

    def _rows(self, chunks: torch.Tensor, *, with_l1: bool) -> torch.Tensor:
        """``(chunks, blocks, k [+ 1])`` in the compute dtype: each block's signed sums [and its
        L1 norm]."""
        compute = _compute_dtype(chunks.dtype)
        n = chunks.shape[1]
        blocks = max(1, math.ceil(n / self.block))
        x = chunks.to(compute)
        if blocks * self.block != n:
            x = F.pad(x, (0, blocks * self.block - n))
        body = x.reshape(chunks.shape[0] * blocks, self.block)
        cols = [body @ fp.sign_matrix(self.block, self.k, self.seed, body.device, compute)]
        if with_l1:
            cols.append(body.abs().sum(dim=1, keepdim=True))
        return torch.cat(cols, dim=1).view(chunks.shape[0], blocks, -1)


def supported(op: object) -> bool:
    """Whether a reduce-scatter with ``op`` can be checked (a sum or a mean; FSDP2 uses a
    pre-multiplied sum only with an explicit gradient divide factor)."""
    return _is_avg(op) or _same_op(op, dist.ReduceOp.SUM)


def finding(statuses: list[int]) -> Finding | None:
    """The step's reduced-gradient finding from every rank's :meth:`ScatterCheck.status`."""
    after = tuple(r for r, s in enumerate(statuses) if s == AFTER)
    wrong = tuple(r for r, s in enumerate(statuses) if s == COLLECTIVE)
    if not after and not wrong:
        return None
    evidence: dict[str, Any] = {"reduce_scatter": [_NAMES.get(int(s), str(s)) for s in statuses]}
    if wrong:
        evidence["note"] = (
            f"the reduce-scatter's output for the shard of rank(s) {list(wrong)} differs from the sum "
            "of every rank's input; the reduction runs through every rank, so no rank is named"
        )
        return Finding(check="reduced_gradients", candidates=tuple(range(len(statuses))), evidence=evidence)
    evidence["note"] = (
        "the reduce-scatter delivered the sum of every rank's input, and the shard then held differed "
        "from it on this rank alone (after the collective); whether it recurs cannot be re-run from "
        "here, so it is classified transient"
    )
    return Finding(check="reduced_gradients", suspects=after, classification="transient", evidence=evidence)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_avg(op: object) -> bool:
    return _same_op(op, dist.ReduceOp.AVG)


def _same_op(op: object, want: object) -> bool:
    try:
        return bool(op == want)
    except TypeError:  # a pre-multiplied sum compares with nothing
        return False
