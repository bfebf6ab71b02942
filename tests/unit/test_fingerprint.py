"""Exact digests and tolerant sketches."""

from __future__ import annotations

import pytest
import torch

from replicheck import fingerprint as fp

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
