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
