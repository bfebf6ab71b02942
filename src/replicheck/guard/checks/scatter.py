"""Plain FSDP2: each reduce-scatter checked against the sum of what every rank put into it.

Under plain FSDP2 one rank alone holds each reduced gradient shard, so no replica can vote on
it. A sketch is linear (the sketch of a sum is the sum of the sketches), which gives a check
that needs no second copy of the shard: before the reduce-scatter every rank sketches each
destination chunk of its input, per block of ``block`` values (``k`` signed sums and the block's
L1 norm); one more reduce-scatter per step, of all the step's sketches together (``(k + 1) / block`` of the gradient's
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
  (in its reduced-gradient hooks, which run on this rank's device), so this rank is named. With
  no hooks registered the shard is the collective's output and is sketched once.
- ``COLLECTIVE``: the collective's output differs from the sum of the inputs. The reduction runs
  through every rank's links and adders, so that evidence names no rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicheck import fingerprint as fp
from replicheck.guard.attribution.verdict import Evidence, Finding

OK, AFTER, COLLECTIVE = 0, 1, 2
_NAMES = {OK: "ok", AFTER: "changed after the reduce-scatter", COLLECTIVE: "reduce-scatter output wrong"}
_SAFETY = 4.0
"""Margin over the rounding bound (itself a worst case: errors rarely all share a sign)."""


@dataclass(frozen=True, kw_only=True)
class _Call:
    local: torch.Tensor
    """``(world, blocks, k + 1)``: this rank's sketches of each destination chunk, and L1 norms."""
    raw: torch.Tensor
    """``(blocks, k)``: the sketch of the collective's output on this rank."""
    rel_eps: float
    """Rounding bound per unit of L1 norm."""
    group: dist.ProcessGroup


class ScatterCheck:
    """One step's reduce-scatter checks on one rank (see the module docstring).

    The sketches of all the step's reduce-scatters travel in one reduce-scatter when the step's
    verdict is asked for (:meth:`status`, on every rank at the same point of the step): one
    synchronisation per step, not one per layer group.
    """

    def __init__(self, *, k: int = 2, block: int = 256, seed: int = 0x5CA7) -> None:
        self.k, self.block, self.seed = k, block, seed
        self.reset()

    def reset(self) -> None:
        """Start a step."""
        self._calls: list[_Call] = []
        self._finals: list[torch.Tensor] = []
        self._status: torch.Tensor | int | None = None

    @property
    def calls(self) -> int:
        """Reduce-scatters checked this step."""
        return len(self._calls)

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
        local = self._rows(buffer.view(world, -1), with_l1=True)  # (world, blocks, k + 1)
        if _is_avg(op):
            local /= world
        dist.reduce_scatter_single(output, buffer, op=op, group=group)
        compute = _compute_dtype(buffer.dtype)
        # Worst-case rounding per unit of L1 norm: the reduction (in the buffer's dtype), both
        # sides' sketches and the sum of the ranks' sketches (in ``compute``).
        eps = torch.finfo(compute).eps
        rel = (world - 1) * torch.finfo(buffer.dtype).eps + (2 * self.block + world - 1) * eps
        raw = self._rows(output.view(1, -1), with_l1=False)[0]
        self._calls.append(_Call(local=local, raw=raw, rel_eps=_SAFETY * rel, group=group))

    def after_hooks(self, shard: torch.Tensor) -> None:
        """The shard after the reduced-gradient hooks ran (what the optimizer will read)."""
        if len(self._finals) < len(self._calls):
            self._finals.append(self._rows(shard.view(1, -1), with_l1=False)[0])

    def status(self) -> torch.Tensor | int:
        """Collective when any reduce-scatter ran: this rank's verdict for the step (a 0-dim
        int64 device tensor; ``0`` when nothing ran). Computed once per step."""
        if self._status is None:
            self._status = self._judge() if self._calls else 0
        return self._status

    def _judge(self) -> torch.Tensor:
        calls, group = self._calls, self._calls[0].group
        dtype = torch.float64 if any(c.local.dtype == torch.float64 for c in calls) else torch.float32
        local = torch.cat([c.local.to(dtype) for c in calls], dim=1)
        expected = torch.empty_like(local[0])
        # One reduce-scatter for the whole step, flat on both sides (gloo checks the first dim).
        dist.reduce_scatter_single(expected.view(-1), local.reshape(-1), op=dist.ReduceOp.SUM, group=group)
        raw = torch.cat([c.raw.to(dtype) for c in calls])
        finals = [f.to(dtype) for f in self._finals] + [c.raw.to(dtype) for c in calls[len(self._finals) :]]
        final = torch.cat(finals)
        rel = torch.cat(
            [torch.full((c.raw.shape[0], 1), c.rel_eps, dtype=dtype, device=raw.device) for c in calls]
        )
        want, l1 = expected[:, : self.k], expected[:, self.k :]
        bound = l1 * rel + torch.finfo(dtype).tiny
        raw_bad = ((raw - want).abs() > bound).any() | ~torch.isfinite(raw).all()
        final_bad = ((final - want).abs() > bound).any() | ~torch.isfinite(final).all()
        # Only bad when the expected sketch itself is finite: a non-finite input is the gradient
        # health check's finding (named on the rank that produced it), not the reduction's.
        sane = torch.isfinite(expected).all()
        status: torch.Tensor = torch.where(raw_bad, COLLECTIVE, torch.where(final_bad, AFTER, OK)) * sane
        return status.to(torch.int64)

    def _rows(self, chunks: torch.Tensor, *, with_l1: bool) -> torch.Tensor:
        """``(chunks, blocks, k [+ 1])`` in the compute dtype: each block's signed sums [and its
        L1 norm]. Each chunk is contiguous: its whole blocks are a view, read once by the matrix
        product and once by the norm (no padded copy); a shorter last block uses the first rows
        of the same signs, on both sides of the comparison alike."""
        compute = _compute_dtype(chunks.dtype)
        x = chunks if chunks.dtype == compute else chunks.to(compute)
        n = x.shape[1]
        m, tail = divmod(n, self.block)
        signs = fp.sign_matrix(self.block, self.k, self.seed, x.device, compute)
        out = []
        for c in x:
            parts = []
            if m:
                body = c[: m * self.block].view(m, self.block)
                cols = [body @ signs]
                if with_l1:
                    cols.append(body.abs().sum(dim=1, keepdim=True))  # faster than vector_norm(ord=1) on CPU
                parts.append(torch.cat(cols, dim=1))
            if tail or not n:
                rest = c[m * self.block :]
                cols = [(rest @ signs[:tail]).view(1, self.k)]
                if with_l1:
                    cols.append(rest.abs().sum().view(1, 1))
                parts.append(torch.cat(cols, dim=1))
            out.append(torch.cat(parts))
        return torch.stack(out)


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
    evidence: Evidence = {"reduce_scatter": [_NAMES.get(int(s), str(s)) for s in statuses]}
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
