from __future__ import annotations

import pytest
import torch

from replicheck.harness.workloads import DecoderConfig, make_model, synthetic_batch

TINY = DecoderConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)


@pytest.fixture
def tiny() -> DecoderConfig:
    return TINY


@pytest.fixture
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical tiny decoders: one to corrupt, one to compare against."""
    return make_model(TINY, seed=0), make_model(TINY, seed=0)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    return synthetic_batch(TINY, step=0, rank=0, batch=2)
