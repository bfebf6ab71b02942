"""Plain FSDP2: each reduce-scatter checked against the sum of what every rank put into it.

Under plain FSDP2 one rank alone holds each reduced gradient shard, so no replica can vote on
it. A sketch is linear (the sketch of a sum is the sum of the sketches), which gives a check
that needs no second copy of the shard: before the reduce-scatter every rank sketches each
destination chunk of its input, per block of ``block`` values (``k`` signed sums and the block's
sum of squares; a chunk's ragged end joins its last block, so a chunk of ``n >= block`` values
has ``n // block`` blocks and the sketches never grow with the world size), all chunks in one
matrix product (no loop over the world); one more
reduce-scatter per step, of all the step's sketches together (``(k + 1) / block`` of the
gradient's values: 1.2 % with the defaults), hands each rank the sketch its shard must have. The
rank then sketches the collective's output (*raw*) and its shard after the reduced-gradient hooks
ran (*final*, what the optimizer will read) and compares both with the expected sketch.
Summation order differs between the two sides, so the comparison allows their rounding: a
statistical bound (8 standard deviations of the rounding errors, random ones growing like the
square root of the world size and ones that share a sign, linearly), sized from each block's sums
of squares (``docs/sharded.md`` derives it). At 8 ranks a single value changed by ~2e-4 of its
block's mean magnitude is seen with a float32 reduction, by ~5× it with a bfloat16 one; a flip
of the last mantissa bits is not, as no tolerance can tell it from rounding.

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
_Z = 8.0
"""Standard deviations of the rounding model a difference may reach before it is a fault. The
variance is itself an upper bound (each rounding error taken at its largest, ``u`` times its
partial sum), so the margin is wider than 8 true standard deviations."""


@dataclass(frozen=True, kw_only=True)
class _Call:
    raw: torch.Tensor
    """``(blocks, k + 1)``: the sketch of the collective's output on this rank, and each
    block's sum of squares."""
    coef: float
    """Rounding variance per unit of a block's sum of squares (see :func:`_variance_coef`)."""
    world: int
    floor: float
    """Absolute allowance for underflow (each rounding near zero may lose one smallest normal)."""
    group: dist.ProcessGroup


class ScatterCheck:
    """One step's reduce-scatter checks on one rank (see the module docstring).

    The sketches of all the step's reduce-scatters travel in one reduce-scatter when the step's
    verdict is asked for (:meth:`status`, on every rank at the same point of the step): one
    synchronisation per step, not one per layer group.
    """

    def __init__(self, *, k: int = 2, block: int = 256, seed: int = 0x5CA7) -> None:
        self.k, self.block, self.seed = k, block, seed
        self._signs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Start a step."""
        self._calls: list[_Call] = []
        self._locals: list[torch.Tensor] = []
        self._finals: list[torch.Tensor] = []
        self._status: torch.Tensor | int | None = None
        self._ratio: torch.Tensor | None = None

    @property
    def calls(self) -> int:
        """Reduce-scatters checked this step."""
        return len(self._calls)

    @property
    def noise_ratio(self) -> torch.Tensor | None:
        """Diagnostics: after :meth:`status`, the step's largest ``|difference| / allowance``
        over every block whose expected sketch is finite (a 0-dim device tensor; above 1 is an
        alarm); ``None`` before."""
        return self._ratio

    def reduce(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
    ) -> torch.Tensor:
        """Reduce-scatter ``buffer`` into ``output`` (a sum or a mean, as FSDP asks), sketching
        both sides; the shard's final sketch is taken by :meth:`after_hooks`.

        Returns the input's squared L2 norm (a 0-dim float64 device tensor, NaN and Inf
        propagated), summed from the sketch's per-block sums of squares: the gradient health
        check's local norm without another read of the buffer (a bfloat16 buffer's block norms
        are rounded to bfloat16, within 1 % of the exact norm)."""
        world = dist.get_world_size(group)
        local = self._sketch(buffer.view(world, -1), squares=True)  # (world, blocks, k + 1)
        sq = local[..., self.k].sum(dtype=torch.float64)
        terms = longest_block(output.numel(), self.block)
        if _is_avg(op):
            local[..., : self.k] /= world
            local[..., self.k :] /= world * world
        dist.reduce_scatter_single(output, buffer, op=op, group=group)
        raw = self._sketch(output.view(1, -1), squares=True)[0]
        self._locals.append(local)
        self._calls.append(
            _Call(
                raw=raw,
                coef=_variance_coef(buffer.dtype, world, terms),
                world=world,
                floor=terms * (world + 2) * float(torch.finfo(buffer.dtype).smallest_normal),
                group=group,
            )
        )
        return sq

    def after_hooks(self, shard: torch.Tensor) -> None:
        """The shard after the reduced-gradient hooks ran (what the optimizer will read)."""
        if len(self._finals) < len(self._calls):
            self._finals.append(self._sketch(shard.view(1, -1), squares=False)[0])

    def status(self) -> torch.Tensor | int:
        """Collective when any reduce-scatter ran: this rank's verdict for the step (a 0-dim
        int64 device tensor; ``0`` when nothing ran). Computed once per step."""
        if self._status is None:
            self._status = self._judge() if self._calls else 0
        return self._status

    def _judge(self) -> torch.Tensor:
        calls, group, k = self._calls, self._calls[0].group, self.k
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in self._locals) else torch.float32
        local = torch.cat([x.to(dtype) for x in self._locals], dim=1)
        self._locals.clear()  # the step's only sketches of whole gradients: freed once packed
        expected = torch.empty_like(local[0])
        # One reduce-scatter for the whole step, flat on both sides (gloo checks the first dim).
        dist.reduce_scatter_single(expected.view(-1), local.reshape(-1), op=dist.ReduceOp.SUM, group=group)
        del local
        raw = torch.cat([c.raw.to(dtype) for c in calls])
        finals = [f.to(dtype) for f in self._finals] + [
            c.raw[:, :k].to(dtype) for c in calls[len(self._finals) :]
        ]
        final = torch.cat(finals)
        self._finals.clear()
        # Each call's constants on every one of its rows, from one small host tensor (a fixed
        # number of operations however many calls and ranks).
        device = raw.device
        params = torch.tensor([[c.coef, c.world, c.floor] for c in calls], dtype=dtype).to(device)
        rows = torch.tensor([c.raw.shape[0] for c in calls]).to(device)
        params = params.repeat_interleave(rows, dim=0, output_size=raw.shape[0])
        coef, world, floor = params.unbind(1)
        want = expected[:, :k]
        bound = _allowance(coef, world, floor, expected[:, k], raw[:, k])
        # Only blocks whose expected sketch is finite are judged: a non-finite input is the
        # gradient health check's finding (named on the rank that produced it), not the reduction's.
        sane = torch.isfinite(expected).all(dim=1)
        raw_diff = (raw[:, :k] - want).abs().amax(dim=1)
        final_diff = (final - want).abs().amax(dim=1)
        raw_bad = ((raw_diff > bound) | ~torch.isfinite(raw[:, :k]).all(dim=1)) & sane
        final_bad = ((final_diff > bound) | ~torch.isfinite(final).all(dim=1)) & sane
        ratio = torch.maximum(raw_diff, final_diff) / bound
        self._ratio = torch.where(sane, ratio, 0).amax() if ratio.numel() else ratio.new_zeros(())
        status = torch.where(raw_bad.any(), COLLECTIVE, torch.where(final_bad.any(), AFTER, OK))
        return status.to(torch.int64)

    def _sketch(self, chunks: torch.Tensor, *, squares: bool) -> torch.Tensor:
        """``(chunks, blocks, k [+ 1])`` in the compute dtype: each block's ``k`` signed sums
        [and its sum of squares], for every chunk at once (see :func:`sketch_chunks`)."""
        dtype = chunks.dtype if chunks.dtype in _NATIVE else torch.float32
        key = (chunks.device, dtype)
        signs = self._signs.get(key)
        if signs is None:
            signs = fp.sign_matrix(self.block, self.k, self.seed, chunks.device, dtype)
            self._signs[key] = signs
        return sketch_chunks(chunks, signs, squares=squares)


_NATIVE = (torch.float32, torch.float64, torch.bfloat16)
"""Dtypes sketched as they are; others (float16, whose sums and norms overflow at 65,504) are
converted to float32 first."""


def longest_block(n: int, block: int) -> int:
    """Values in the longest block of a chunk of ``n`` (the last, which takes the ragged end)."""
    return block + n % block if n > block else block


def sketch_chunks(chunks: torch.Tensor, signs: torch.Tensor, *, squares: bool) -> torch.Tensor:
    """``(c, blocks, k [+ 1])``: the ``k`` signed sums (``signs``: ``block × k`` ±1) of every
    block of ``block`` values of each of the ``c`` rows of ``chunks`` [and each block's sum of
    squares], in float32 (float64 for a float64 input). A row's ragged end (``n mod block``
    values, projected by the first rows of the same signs) is added to its last whole block: a
    row of ``n >= block`` values has ``n // block`` blocks (one for a shorter row), so the
    sketches of a buffer split into more chunks are never larger (their bytes in the check's
    reduce-scatter do not grow with the world size while a chunk holds a whole block).

    The whole blocks of every row are one ``(c, m, block)`` view of the buffer, projected by one
    matrix product; the rows' ragged ends are one more. So the number of operations does not depend on ``c``
    (the world size), and nothing of the buffer's size is copied for float32, float64 or
    bfloat16: a bfloat16 product is taken in bfloat16 (each output rounded once to bfloat16, an
    error the allowance counts; the accumulation is in float32 in torch's kernels), and on CUDA
    with a float32 result directly (``out_dtype``). A ragged bfloat16 view may still be packed by
    torch's CPU kernel, in bfloat16."""
    compute = torch.float64 if chunks.dtype == torch.float64 else torch.float32
    x = chunks if chunks.dtype in _NATIVE else chunks.to(compute)
    c, n = x.shape
    block = signs.shape[0]
    m, tail = divmod(n, block)
    if not m:
        return _columns(x.unsqueeze(1), signs[:n], compute, squares)
    whole = _columns(x[:, : m * block].view(c, m, block), signs, compute, squares)
    if tail:
        whole[:, -1:] += _columns(x[:, m * block :].unsqueeze(1), signs[:tail], compute, squares)
    return whole


def _columns(x: torch.Tensor, signs: torch.Tensor, compute: torch.dtype, squares: bool) -> torch.Tensor:
    """``(c, rows, k [+ 1])`` of a ``(c, rows, width)`` view."""
    sums = _project(x, signs, compute)
    if not squares:
        return sums
    # The sum of squares only sizes the allowance: a norm rounded to bfloat16 is plenty, and
    # takes no float32 copy of the view.
    sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).to(compute).square()
    return torch.cat([sums, sq], dim=-1)


_NO_OUT_DTYPE: set[torch.device] = set()
"""Devices where ``bmm(..., out_dtype=)`` was refused (then the product's result is rounded to
bfloat16, which the allowance counts anyway)."""


def _project(x: torch.Tensor, signs: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    if x.dtype != compute and x.is_cuda and x.device not in _NO_OUT_DTYPE:
        # A bfloat16 product with a float32 result (cuBLAS accumulates in float32), batched over
        # the chunks with the signs broadcast (stride 0): no copy of the view. Not verified on a
        # GPU yet: a refusal (an older torch, a layout cuBLAS does not take) falls back.
        try:
            return torch.bmm(x, signs.expand(x.shape[0], *signs.shape), out_dtype=compute)
        except (RuntimeError, TypeError):
            _NO_OUT_DTYPE.add(x.device)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # On the CPU, signsᵀ · xᵀ (the blocks as the product's long dimension, the k × block
        # signs contiguous) runs about twice as fast as x · signs, a product with k = 2 columns,
        # and reads the view in place; bfloat16's CPU kernel is faster the other way round.
        return torch.matmul(signs.t().contiguous(), x.transpose(1, 2)).transpose(1, 2)
    out = x @ signs
    return out if out.dtype == compute else out.to(compute)


def _allowance(
    coef: torch.Tensor | float,
    world: torch.Tensor | int,
    floor: torch.Tensor | float,
    q: torch.Tensor,
    y2: torch.Tensor,
) -> torch.Tensor:
    """The largest rounding difference allowed per block, from the ranks' summed sums of squares
    ``q`` and the output's ``y2``; ``coef`` from :func:`_variance_coef`, ``floor`` for underflow."""
    # The output's own sum of squares, capped by what the inputs allow (y² <= world·Σ x²): a
    # corrupted output cannot widen its own allowance past the inputs'.
    var = coef * (torch.minimum(y2, world * q) + q)
    return _Z * var.sqrt() + floor + torch.finfo(q.dtype).tiny


def _variance_coef(dtype: torch.dtype, world: int, block: int) -> float:
    """Rounding variance of (the sketch of the output) − (the sum of the ranks' sketches), per
    unit of ``Y + Q`` (``Y``: the output block's sum of squares, ``Q``: the ranks' summed sums of
    squares), as ``docs/sharded.md`` derives it: the reduction's ``world − 1`` roundings in the
    buffer's dtype (and a mean's division) as independent errors, plus the part of them that can
    share a sign (a value common to the ranks lost under a larger partial sum on every addition:
    linear in ``world``), the sketches' one rounding to a bfloat16 product, and the sketches'
    ``block``-term products and their ``world``-term sum in the compute dtype."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    u = torch.finfo(dtype).eps / 2
    u_out = u if dtype not in (torch.float32, torch.float64) else 0.0
    u_c = torch.finfo(compute).eps / 2
    return u * u * (world + 1 + world * world / 4) + u_out * u_out + u_c * u_c * (block + world + 2)


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


def _is_avg(op: object) -> bool:
    return _same_op(op, dist.ReduceOp.AVG)


def _same_op(op: object, want: object) -> bool:
    try:
        return bool(op == want)
    except TypeError:  # a pre-multiplied sum compares with nothing
        return False
