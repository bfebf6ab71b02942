"""The sketches of plain FSDP2's reduce-scatter check (``replicheck.guard.checks.scatter``) in one
process: their cost does not depend on the world size, and they are the blocks' signed sums and
sums of squares."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from replicheck import fingerprint as fp
from replicheck.guard.checks import scatter

pytestmark = pytest.mark.timeout(60)


class _Ops(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _fake_world(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """A world of ``world`` ranks without processes: the collective hands this rank its chunk."""

    def reduce_scatter_single(output: torch.Tensor, buffer: torch.Tensor, **_: Any) -> None:
        output.copy_(buffer.view(world, -1)[0])

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter_single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shard", [10_000, 10_240, 7])
def test_reduce_dispatches_the_same_operations_at_every_world_size(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, shard: int
) -> None:
    """One checked reduce-scatter (sketching every destination chunk, the collective, sketching
    the output) dispatches as many aten operations at 2, 8 and 32 ranks: no loop over chunks
    (shards with and without a ragged last block, and shorter than a block)."""
    counts = []
    for world in (2, 8, 32):
        _fake_world(monkeypatch, world)
        buffer = torch.randn(world * shard).to(dtype)
        output = torch.empty(shard, dtype=dtype)
        check = scatter.ScatterCheck()
        check.reduce(output, buffer, dist.group.WORLD, dist.ReduceOp.AVG)  # the signs, made once
        check.reset()
        with _Ops() as ops:
            check.reduce(output, buffer, dist.group.WORLD, dist.ReduceOp.AVG)
        counts.append(ops.count)
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0] <= 96, counts  # views, transposes and dtype conversions included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketch_is_one_product_whatever_the_chunk_count(dtype: torch.dtype) -> None:
    """``sketch_chunks`` over a fixed buffer viewed as 2, 8 and 32 chunks dispatches the same
    operations, one matrix product for the whole blocks and one for the ragged tails."""
    signs = fp.sign_matrix(256, 2, 1, torch.device("cpu"), dtype)
    counts = []
    for world in (2, 8, 32):
        chunks = torch.randn(world, 1000).to(dtype)
        with _Ops() as ops:
            scatter.sketch_chunks(chunks, signs, squares=True)
        counts.append(ops.count)
    assert counts[0] == counts[1] == counts[2], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sketch_is_each_blocks_signed_sums_and_sum_of_squares(dtype: torch.dtype) -> None:
    """Against a float64 reference per chunk and block (a ragged end joining the last block, a
    chunk shorter than a block, and an empty chunk): the signed sums agree within a few
    roundings of the dtype, the sums of squares within a bfloat16 norm's rounding."""
    g = torch.Generator().manual_seed(3)
    for n in (0, 100, 256, 700):
        chunks = (torch.randn(4, n, generator=g) * 10).to(dtype)
        signs = fp.sign_matrix(
            256, 2, 9, torch.device("cpu"), dtype if dtype != torch.float16 else torch.float32
        )
        got = scatter.sketch_chunks(chunks, signs, squares=True).double()
        ref_signs = signs.double()
        for c in range(4):
            x = chunks[c].double()
            m = max(n // 256, 1)
            bounds = [(b * 256, (b + 1) * 256 if b < m - 1 else n) for b in range(m)]
            assert got.shape[1] == len(bounds) == scatter.sketch_chunks(chunks, signs, squares=False).shape[1]
            for b, (s, e) in enumerate(bounds):
                block = x[s:e]
                sig = torch.cat([ref_signs, ref_signs])[: block.numel()]
                want = block @ sig
                scale = float(block.abs().sum()) + 1e-30
                tol = 4 * torch.finfo(dtype).eps * scale + 256 * 1e-7 * scale
                assert torch.allclose(got[c, b, :2], want, atol=tol, rtol=0), (n, c, b)
                assert (
                    abs(float(got[c, b, 2]) - float(block.square().sum()))
                    <= 0.02 * float(block.square().sum()) + 1e-30
                )


def test_allowance_is_a_fraction_of_the_former_worst_case() -> None:
    """For a Gaussian block summed over identical ranks, the allowance is under a tenth of the
    former bound (4 × the worst case from the ranks' L1 norms) at 8, 32 and 1,024 ranks, float32
    and bfloat16."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        for world in (8, 32, 1024):
            y = world * x
            q, y2 = world * x.square().sum(), y.square().sum()
            now = scatter._allowance(scatter._variance_coef(dtype, world, 256), world, 0.0, q, y2)
            eps, eps_c = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
            before = 4 * ((world - 1) * eps + (2 * 256 + world - 1) * eps_c) * world * x.abs().sum()
            assert float(now) < float(before) / 10, (dtype, world)


def test_a_corrupted_output_cannot_widen_its_allowance_past_the_inputs() -> None:
    """The output's sum of squares sizes the allowance only up to ``world`` × the inputs' (a
    huge wrong value leaves it where the inputs put it)."""
    coef = scatter._variance_coef(torch.bfloat16, 1024, 256)
    q = torch.tensor(1.0, dtype=torch.float64)
    capped = scatter._allowance(coef, 1024, 0.0, q, torch.tensor(1e30, dtype=torch.float64))
    at_cap = scatter._allowance(coef, 1024, 0.0, q, torch.tensor(1024.0, dtype=torch.float64))
    assert float(capped) == float(at_cap)


def _heavy(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Student-t (2 degrees of freedom) × lognormal magnitudes, random signs."""
    t = torch.randn(shape, generator=g) / (
        torch.randn((2, *shape), generator=g).square().mean(0).sqrt() + 1e-12
    )
    return t * torch.exp(torch.randn(shape, generator=g) * 2)


def _ring_ratio(world: int, chunks: int, dtype: torch.dtype, share: float, seed: int) -> float:
    """Largest |difference| / allowance over ``chunks`` destination chunks of a simulated ring
    reduce-scatter (chunk ``d`` summed from rank ``d + 1`` on, rounding in ``dtype`` at each
    addition), of gradients with ``share`` common to every rank."""
    g = torch.Generator().manual_seed(seed)
    shard = 512 + 37 * (seed % 5)
    x = (share * _heavy(g, (1, chunks, shard)) + (1 - share) * _heavy(g, (world, chunks, shard))).to(dtype)
    d = torch.arange(chunks)
    acc = x[(d + 1) % world, d].clone()
    for i in range(2, world + 1):
        acc = acc + x[(d + i) % world, d]
    signs = fp.sign_matrix(256, 2, 0x5CA7, torch.device("cpu"), dtype)
    expected = scatter.sketch_chunks(x.reshape(world * chunks, shard), signs, squares=True)
    expected = expected.view(world, chunks, -1, 3).sum(0)
    raw = scatter.sketch_chunks(acc, signs, squares=True)
    terms = scatter.longest_block(shard, 256)
    floor = terms * (world + 2) * float(torch.finfo(dtype).smallest_normal)
    bound = scatter._allowance(
        scatter._variance_coef(dtype, world, terms), world, floor, expected[..., 2], raw[..., 2]
    )
    return float(((raw[..., :2] - expected[..., :2]).abs().amax(-1) / bound).max())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_simulated_ring_reductions_stay_within_the_allowance_up_to_16384_ranks() -> None:
    """Ring-order reductions simulated in float32 and bfloat16 at 128 to 16,384 ranks, of
    heavy-tailed gradients with a share common to the ranks from none to all (where roundings
    share a sign): every difference within the allowance (figures in ``docs/sharded.md``)."""
    for world, chunks in ((128, 16), (1024, 8), (4096, 2), (16384, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            ratios = [
                _ring_ratio(world, chunks, dtype, share, seed=world + t)
                for t, share in enumerate((0.0, 0.5, 0.9, 1.0))
            ]
            print(f"{world} ranks, {dtype}: largest |difference|/allowance {max(ratios):.3f}")
            assert max(ratios) < 1, (world, dtype, ratios)


@pytest.mark.parametrize(
    ("dtype", "rel"),
    [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 1e-2), (torch.float16, 1e-5)],
)
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_reduce_returns_the_inputs_squared_norm(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rel: float, op: Any
) -> None:
    """``reduce`` returns the squared L2 norm of the whole input (every destination chunk, before
    a mean's division), as the gradient health check's ``sq_norm`` gives it, from the sketch's
    block sums of squares (bfloat16 block norms are rounded: within 1 %); NaN and Inf propagate."""
    from replicheck.guard.checks.health import sq_norm

    _fake_world(monkeypatch, 4)
    buffer = (torch.randn(4 * 3000) * 3).to(dtype)
    output = torch.empty(3000, dtype=dtype)
    got = scatter.ScatterCheck().reduce(output, buffer, dist.group.WORLD, op)
    want = sq_norm(buffer)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(float(got) - float(want)) <= rel * float(want), (float(got), float(want))
    for bad in (float("nan"), float("inf")):
        poisoned = buffer.clone()
        poisoned[7_777] = bad
        sq = scatter.ScatterCheck().reduce(output, poisoned, dist.group.WORLD, op)
        assert not torch.isfinite(sq), bad
