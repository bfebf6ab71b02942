"""Corruption patterns and schedules, on plain tensors."""

from __future__ import annotations

import pytest
import torch

from replicheck.faults import (
    BitFlip,
    FaultConfigError,
    Intermittent,
    NonFinite,
    Persistent,
    Scale,
    SdcMix,
    Transient,
    ZeroChunk,
)
from replicheck.faults.patterns import bit_range
from replicheck.faults.schedule import Trigger


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.timeout(30)
def test_bitflip_changes_exactly_the_named_bit_of_one_value() -> None:
    """A fixed-bit flip changes one element, and in it exactly that bit."""
    t = torch.randn(100)
    before = t.clone()
    ch = BitFlip(bit=22, index=17).apply(t, _gen())
    xor = t.view(torch.int32) ^ before.view(torch.int32)
    assert xor.nonzero().flatten().tolist() == [17]
    assert int(xor[17]) == 1 << 22
    assert ch.positions == (17,) and ch.bit == 22
    assert ch.old == (float(before[17]),) and ch.new == (float(t[17]),)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field", ["mantissa", "exponent"])
def test_random_bitflip_stays_in_its_field(field: str) -> None:
    """Random flips draw their bit from the requested field (fp32 and bf16)."""
    for dtype in (torch.float32, torch.bfloat16):
        lo, hi = bit_range(dtype, field)  # type: ignore[arg-type]
        gen = _gen(3)
        for _ in range(50):
            t = torch.ones(8, dtype=dtype)
            ch = BitFlip(field=field).apply(t, gen)  # type: ignore[arg-type]
            assert ch.bit is not None and lo <= ch.bit <= hi


@pytest.mark.timeout(30)
def test_sign_bit_flip_negates() -> None:
    """Flipping the top bit flips the sign and nothing else."""
    t = torch.tensor([1.5, 2.0])
    BitFlip(bit=31, index=1).apply(t, _gen())
    assert t.tolist() == [1.5, -2.0]


@pytest.mark.timeout(30)
def test_zero_chunk_zeroes_one_aligned_chunk_of_32() -> None:
    """Zeroing hits one aligned 32-wide chunk, every value in it, and nothing outside."""
    t = torch.randn(200) + 5.0
    before = t.clone()
    ch = ZeroChunk(index=70).apply(t, _gen())
    assert ch.positions == tuple(range(64, 96))
    changed = (t != before).nonzero().flatten().tolist()
    assert changed == list(range(64, 96)) and bool((t[64:96] == 0).all())


@pytest.mark.timeout(30)
def test_scale_and_nonfinite_values() -> None:
    """Scaling multiplies exactly the chosen values; NaN/Inf replace exactly one value."""
    t = torch.arange(10, dtype=torch.float32)
    Scale(factor=4.0, count=2, index=3).apply(t, _gen())
    assert t.tolist() == [0, 1, 2, 12, 16, 5, 6, 7, 8, 9]
    NonFinite(value="nan", index=0).apply(t, _gen())
    NonFinite(value="-inf", index=9).apply(t, _gen())
    assert t[0].isnan() and t[9] == float("-inf") and t[1:9].isfinite().all()


@pytest.mark.timeout(30)
def test_sdc_mix_is_seeded_and_mostly_finite() -> None:
    """The published mix is reproducible from its seed and yields NaN/Inf ~1% of the time."""

    def kinds(seed: int) -> list[str]:
        gen = _gen(seed)
        return [SdcMix().apply(torch.ones(64), gen).kind for _ in range(3000)]

    a = kinds(5)
    assert a == kinds(5)
    nonfinite = sum(k in ("nan", "inf") for k in a) / len(a)
    assert 0.002 < nonfinite < 0.025
    assert a.count("zero_chunk") > 0.4 * len(a) and a.count("bitflip") > 0.4 * len(a)


@pytest.mark.timeout(30)
def test_schedules_fire_when_they_say() -> None:
    """Persistent fires from its step on; transient once at its step; intermittent ~p, seeded."""
    p = Trigger(Persistent(start=3), seed=0)
    assert [p.fires(s) for s in range(6)] == [False, False, False, True, True, True]
    t = Trigger(Transient(step=4), seed=0)
    assert [t.fires(s) for s in (3, 4, 4, 5)] == [False, True, False, False]
    draws = [Trigger(Intermittent(p=0.3, start=2), seed=9) for _ in range(2)]
    seqs = [[d.fires(s) for s in range(2, 2002)] for d in draws]
    assert seqs[0] == seqs[1] and 0.25 < sum(seqs[0]) / 2000 < 0.35
    assert not Trigger(Intermittent(p=1.0, start=5), seed=0).fires(4)


@pytest.mark.timeout(30)
def test_bad_descriptions_raise_typed_errors() -> None:
    """Invalid patterns and schedules raise FaultConfigError, not assertions."""
    with pytest.raises(FaultConfigError):
        ZeroChunk(width=0)
    with pytest.raises(FaultConfigError):
        Intermittent(p=1.5)
    with pytest.raises(FaultConfigError):
        BitFlip(bit=40, index=0).apply(torch.ones(3), _gen())
    with pytest.raises(FaultConfigError):
        BitFlip().apply(torch.ones(3, dtype=torch.int64), _gen())
