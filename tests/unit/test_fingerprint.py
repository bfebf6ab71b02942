"""Exact digests and tolerant sketches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replicheck import fingerprint as fp
from replicheck import fused_digest as fd

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_digest(dtype: torch.dtype) -> None:
    """Flipping any one bit of any element changes the exact digest."""
    x = torch.randn(37, dtype=torch.float32).to(dtype)
    base = fp.tensor_digest(x)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for i in range(x.numel()):
        for bit in range(x.element_size() * 8):
            y = x.clone()
            y.view(ints).view(-1)[i] ^= (
                torch.tensor(1, dtype=ints) << bit
                if bit < x.element_size() * 8 - 1
                else torch.tensor(torch.iinfo(ints).min, dtype=ints)
            )
            assert fp.tensor_digest(y) != base, (i, bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 37, 16 * 8 + 3])
def test_every_single_bit_flip_changes_the_row_digest(dtype: torch.dtype, n: int) -> None:
    """The one-read in-step digest also changes on any single flipped bit, whatever the length
    (rows of 16 words, a word tail and a tail shorter than a word), and equal bits digest equal,
    a view that starts inside a word included."""
    x = torch.randn(n, dtype=torch.float32).to(dtype)
    base = int(fp.row_digest(x))
    assert int(fp.row_digest(x.clone())) == base
    padded = torch.cat([torch.zeros(1, dtype=dtype), x])
    assert int(fp.row_digest(padded[1:])) == base, "a misaligned view digests as its clone"
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for i in range(n):
        for bit in range(x.element_size() * 8):
            y = x.clone()
            y.view(ints)[i] ^= (
                torch.tensor(1, dtype=ints) << bit
                if bit < x.element_size() * 8 - 1
                else torch.tensor(torch.iinfo(ints).min, dtype=ints)
            )
            assert int(fp.row_digest(y)) != base, (i, bit)


def test_row_digest_sees_swaps_across_rows_and_lengths() -> None:
    """Rows are weighted by position: a swap of values in different rows of 16 words shows, and
    so does an extra trailing zero (the length is mixed in)."""
    x = torch.randn(1000)
    base = int(fp.row_digest(x))
    for i, j in [(0, 40), (3, 900), (31, 32)]:
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert int(fp.row_digest(y)) != base, (i, j)
    assert int(fp.row_digest(torch.cat([x, torch.zeros(1)]))) != base


def test_swapping_two_values_changes_the_digest() -> None:
    """The digest is position-weighted: a swap of two different values shows, within and across rows."""
    x = torch.randn(1000)
    base = fp.tensor_digest(x)
    for i, j in [(0, 1), (3, 900), (40, 41), (17, 33)]:
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert fp.tensor_digest(y) != base, (i, j)


def test_equal_bits_equal_digests_and_zero_folding() -> None:
    """Equal tensors digest equal; -0.0 and +0.0 differ unless folded."""
    x = torch.randn(100)
    assert fp.tensor_digest(x) == fp.tensor_digest(x.clone())
    z = torch.zeros(8)
    assert fp.tensor_digest(z) != fp.tensor_digest(-z)
    assert fp.tensor_digest(z, fold_zero=True) == fp.tensor_digest(-z, fold_zero=True)


def test_none_and_empty_have_stable_digests() -> None:
    """An unused parameter's missing gradient has its own constant digest, distinct from zeros."""
    assert fp.tensor_digest(None) == fp.tensor_digest(None)
    assert fp.tensor_digest(None) != fp.tensor_digest(torch.zeros(4))


def test_sketch_distance_ignores_rounding_noise_and_sees_real_change() -> None:
    """Relative noise of 1e-7 stays far below 1e-5; a changed element of one tensor does not."""
    x = [torch.randn(5000), torch.randn(300)]
    noisy = [t * (1 + 1e-7 * torch.randn_like(t)) for t in x]
    a, b = fp.sketches(x, seed=3), fp.sketches(noisy, seed=3)
    assert float(fp.sketch_distance(a, b).max()) < 1e-5
    changed = [x[0], x[1].clone()]
    changed[1][7] += 0.5
    d = fp.sketch_distance(a, fp.sketches(changed, seed=3))
    assert float(d[0]) == 0.0 and float(d[1]) > 1e-3


def test_sketch_distance_flags_non_finite() -> None:
    """A NaN anywhere makes that tensor's distance infinite."""
    x = torch.randn(600)
    y = x.clone()
    y[3] = float("nan")
    d = fp.sketch_distance(fp.sketches([x], seed=1), fp.sketches([y], seed=1))
    assert d[0] == float("inf")


def test_per_block_sketch_sees_a_sparse_change_the_whole_tensor_dilutes() -> None:
    """x1.5 on 8 of 100,000 values: against its 256-value block it is a large change, against the
    whole tensor's norm it is below 1e-2."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[50_000:50_008] *= 1.5
    whole = fp.sketch_distance(fp.sketches([x], seed=5, block=10**6), fp.sketches([y], seed=5, block=10**6))
    blocks = fp.sketch_distance(fp.sketches([x], seed=5, block=256), fp.sketches([y], seed=5, block=256))
    assert float(whole[0]) < 1e-2 < 4e-2 < float(blocks[0])


def test_sketch_rows_cover_every_block_tail_and_missing_gradient() -> None:
    """One row per block (the last one shorter), one zero row for a missing gradient, tensor index
    in column 0 and values per block in column 1; the norms are the blocks' norms."""
    x = torch.randn(600)
    s = fp.sketches([x, None, torch.randn(3)], seed=2, k=4, block=256)
    assert s.shape == (5, 7)
    assert s[:, 0].tolist() == [0, 0, 0, 1, 2] and s[:, 1].tolist() == [256, 256, 88, 0, 3]
    assert torch.allclose(s[:3, 2], torch.stack([c.double().norm() for c in x.split(256)]).to(s.dtype))
    assert s[3, 2:].abs().sum() == 0
    assert fp.sketch_distance(s, s.clone()).tolist() == [0.0, 0.0, 0.0]


def test_signs_are_hashed_per_seed_and_cached_per_shape() -> None:
    """Sign vectors are ±1, about half each, equal for equal seeds, different across seeds, and
    the position part is computed once per shape and device."""
    cpu = torch.device("cpu")
    a = fp._signs(4096, 4, 11, cpu, torch.float32)
    assert set(a.unique().tolist()) == {-1.0, 1.0} and abs(float(a.mean())) < 0.05
    assert torch.equal(a, fp._signs(4096, 4, 11, cpu, torch.float32))
    b = fp._signs(4096, 4, 12, cpu, torch.float32)
    assert 0.4 < float((a != b).float().mean()) < 0.6
    assert (4096, 4, cpu) in fp._sign_base
    cols = a.t() @ a / 4096  # the k projections are nearly independent
    assert float((cols - torch.eye(4)).abs().max()) < 0.1


def test_block_that_nearly_cancels_does_not_amplify_noise() -> None:
    """A block of tiny values next to large ones is scaled by its share of the tensor's norm, so
    relative noise of 1e-7 on it stays below 1e-5."""
    x = torch.cat([torch.randn(256), torch.randn(256) * 1e-9])
    noisy = x * (1 + 1e-7 * torch.randn_like(x))
    d = fp.sketch_distance(fp.sketches([x], seed=1, block=256), fp.sketches([noisy], seed=1, block=256))
    assert float(d[0]) < 1e-5


def test_malformed_or_mismatched_sketch_is_a_disagreement() -> None:
    """A peer's sketch of another layout, or not a sketch at all, gives inf, not an exception."""
    a = fp.sketches([torch.randn(600)], seed=1, block=256)
    b = fp.sketches([torch.randn(600)], seed=1, block=128)
    assert fp.sketch_distance(a, b).tolist() == [float("inf")]
    assert fp.sketch_distance(a, torch.zeros(0)).tolist() == [float("inf")]
    bad = a.clone()
    bad[0, 0] = 1e12
    assert fp.sketch_distance(bad, bad).tolist() == [float("inf")]
    with pytest.raises(ValueError, match="block"):
        fp.sketches([torch.randn(3)], seed=1, block=0)


# -- the fused path: many tensors at once ---------------------------------------------------------

_SIZES = st.lists(st.integers(min_value=0, max_value=3000), min_size=2, max_size=12)


def _tensors(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
    return [torch.randn(n, generator=g).to(dtypes[i % len(dtypes)]) for i, n in enumerate(sizes)]


def _reference(t: torch.Tensor | None) -> int:
    """The per-tensor definition written out: rows of 16 words, odd row and even column weights."""
    if t is None:
        return fd.NONE_DIGEST
    w = fd.words(t).to(torch.int64)
    n = w.numel()
    m = n // fd.ROW
    total = fd.wrap(n * fd.K_TAIL)
    weight = [fd.wrap((i + 1) * fd.K_ROW) | 1 for i in range(max(m, n - m * fd.ROW, fd.ROW))]
    for i, x in enumerate(w.tolist()):
        if i < m * fd.ROW:
            r, c = divmod(i, fd.ROW)
            total += x * (weight[r] + fd.wrap(weight[c] * 2 * fd.K_COL))
        else:
            total += x * fd.wrap(weight[i - m * fd.ROW] * fd.K_TAIL)
    return fd.wrap(total)


def test_fused_digests_equal_the_per_tensor_definition() -> None:
    """Small, large, chunk-split, odd-width and ``None`` tensors digest to their definition's value."""
    g = torch.Generator().manual_seed(1)
    ts: list[torch.Tensor | None] = [
        torch.randn(n, generator=g).to(dt)
        for n, dt in [(5, torch.float32), (2049, torch.bfloat16), (20000, torch.float32), (7, torch.int8)]
    ]
    ts.insert(2, None)
    got = fp.digests(ts).tolist()
    assert got == [_reference(t) for t in ts]
    saved = fd._CHUNK_WORDS
    try:
        fd._CHUNK_WORDS = 64  # every tensor in its own chunk
        assert fp.digests(ts).tolist() == got
    finally:
        fd._CHUNK_WORDS = saved


@settings(max_examples=40, deadline=None)
@given(sizes=_SIZES, seed=st.integers(0, 2**31), data=st.data())
def test_any_single_bit_flip_in_any_tensor_changes_the_combined_digest(
    sizes: list[int], seed: int, data: st.DataObject
) -> None:
    """Flipping one bit anywhere in any one of many tensors changes the combined weights digest."""
    ts = _tensors(sizes, seed)
    candidates = [i for i, t in enumerate(ts) if t.numel()]
    if not candidates:
        return
    i = data.draw(st.sampled_from(candidates))
    pos = data.draw(st.integers(0, ts[i].numel() - 1))
    bit = data.draw(st.integers(0, ts[i].element_size() * 8 - 1))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ts[i].element_size()]
    base = fp.weights_digest(ts)
    flipped = [t.clone() for t in ts]
    view = flipped[i].view(ints).view(-1)
    view[pos] = view[pos] ^ (torch.tensor(1, dtype=torch.int64) << bit).to(ints)
    assert fp.weights_digest(flipped) != base


@settings(max_examples=40, deadline=None)
@given(sizes=_SIZES, seed=st.integers(0, 2**31), data=st.data())
def test_moving_a_value_between_tensors_changes_the_combined_digest(
    sizes: list[int], seed: int, data: st.DataObject
) -> None:
    """Swapping a value of one tensor with a different value of another changes the combined digest."""
    ts = [t.float() for t in _tensors(sizes, seed)]
    nonempty = [i for i, t in enumerate(ts) if t.numel()]
    if len(nonempty) < 2:
        return
    a, b = data.draw(st.lists(st.sampled_from(nonempty), min_size=2, max_size=2, unique=True))
    pa, pb = data.draw(st.integers(0, ts[a].numel() - 1)), data.draw(st.integers(0, ts[b].numel() - 1))
    if ts[a][pa] == ts[b][pb]:
        return
    moved = [t.clone() for t in ts]
    moved[a][pa], moved[b][pb] = ts[b][pb], ts[a][pa]
    assert fp.weights_digest(moved) != fp.weights_digest(ts)


@settings(max_examples=25, deadline=None)
@given(sizes=_SIZES, seed=st.integers(0, 2**31))
def test_fused_digests_are_those_of_each_tensor_alone(sizes: list[int], seed: int) -> None:
    """Digesting many tensors at once gives each tensor the digest it has alone (equal bits, equal digest)."""
    ts = _tensors(sizes, seed)
    assert fp.digests(ts).tolist() == [fp.tensor_digest(t) for t in ts]
    assert fp.digests(ts, fold_zero=True).tolist() == [fp.tensor_digest(t, fold_zero=True) for t in ts]
    assert fp.weights_digest(ts) == int(fp.combine(fp.digests(ts)))


def test_digests_create_no_host_tensor_for_a_cached_layout() -> None:
    """Once a layout is cached, digesting builds no tensor from host data (nothing to copy to a device)."""
    ts = _tensors([10, 5000, 3, 40000], 0)
    fp.weights_digest_tensor(ts)
    seen: list[str] = []
    real = torch.tensor

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append("torch.tensor")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    torch.tensor = spy  # type: ignore[assignment]
    try:
        out = fp.weights_digest_tensor(ts)
        fp.digests(ts, fold_zero=True)
    finally:
        torch.tensor = real  # type: ignore[assignment]
    assert seen == [] and out.dim() == 0


def test_digest_values_are_those_checkpoint_manifests_were_written_with() -> None:
    """Known values (computed by the per-tensor implementation before the fused one, on exactly
    rounded inputs) still come out, so manifests written before the fused digests still verify."""
    ts: list[torch.Tensor | None] = [
        torch.arange(40, dtype=torch.float32) / 7,
        torch.arange(5000, dtype=torch.float64) * 0.37 - 11.5,
        (torch.arange(3001) % 251).to(torch.uint8),
        None,
        (torch.arange(70000, dtype=torch.float32) / 9 - 3).to(torch.bfloat16),
    ]
    assert [fp.tensor_digest(t) for t in ts] == [
        -2148113422080151725,
        -7358407754161062191,
        6112585133768948820,
        6840123409045651457,
        -6395374478416323784,
    ]
    assert fp.weights_digest(ts) == -4922199187997557277
    state = {
        0: {"exp_avg": torch.arange(10.0) / 3, "step": torch.tensor(4.0)},
        1: {"exp_avg": torch.arange(2000.0) * 0.01 - 5, "step": torch.tensor(4.0)},
    }
    assert fp.optimizer_digest(state) == -7458013674103572681
