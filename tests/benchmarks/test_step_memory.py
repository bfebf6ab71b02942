"""benchmarks/step_memory.py: bytes a guarded step allocates against the plain step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_memory  # noqa: E402
from replicheck.harness.workloads import DecoderConfig  # noqa: E402


def test_the_counter_sees_new_tensors_and_not_views_or_in_place_results() -> None:
    """A new tensor counts its storage's bytes, a view or an in-place result nothing; the peak is
    the most held at once."""
    x = torch.ones(1000)
    with step_memory.AllocationCounter() as c:
        y = x * 2  # 4,000 new bytes
        y.add_(1)  # in place: nothing
        v = y.view(10, 100)  # a view: nothing
        del y, v
        z = x + 1  # 4,000 more; y's storage is gone by now
    assert c.bytes == 8000 and c.peak == 4000
    assert z.numel() == 1000


@pytest.mark.timeout(180)
def test_an_ordinary_guarded_step_allocates_what_the_plain_step_does() -> None:
    """Two gloo ranks, a tiny decoder, one verification period at the published schedule: an
    ordinary guarded step allocates within 1 % of the plain step's bytes, and its peak of live new
    tensors is within 5 % of the plain step's (at this size a verification step's gradient-sized
    temporaries outweigh the activations; at the benchmark's size its peak equals the plain one)."""
    tiny = DecoderConfig(vocab=64, d_model=32, n_layers=1, n_heads=4, seq_len=16)
    for r in step_memory.measure(tiny, batch=2):
        assert r["ordinary_ratio"] <= 1.01, r
        assert r["ordinary_peak_ratio"] <= 1.05, r
