"""The shapes and budgets of ``gpu_check.py``: the full GPU run and its ``--tiny`` CPU twin."""

from __future__ import annotations

from dataclasses import dataclass, replace

from replicheck.harness.workloads import DecoderConfig


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    """Everything that differs between the GPU run and ``--tiny``; the code paths are the same."""

    device: str
    """``cuda`` or ``cpu``."""
    multi_backend: str
    """Backend of the multi-process guard runs (gloo: NCCL cannot put two ranks on one device)."""
    single_backend: str
    """Backend of the world-size-1 smoke and of the step-time ratio (``nccl`` on a GPU)."""
    ranks: int
    """Processes sharing the device in the guard runs (3: enough to name a culprit)."""
    small: DecoderConfig
    """The small Llama-style model of the guard runs and the smoke."""
    small_batch: int
    """Sequences per rank per step in the guard runs."""
    steps: int
    """Steps of each guard run."""
    verify_every: int
    """Verification (and weights) period of the guard runs."""
    fault_onset: int
    """First faulty step of the fault runs (caught at the next verification step)."""
    save_at: int
    """The clean run saves a checkpoint after this step; the resumed run continues from it."""
    dropout: float
    """Dropout on the embeddings of the guard runs' model (exercises the device RNG on resume)."""
    tensor_bytes: int
    """Size of the tensor whose fingerprint throughput is measured."""
    repeats: int
    """Timed repetitions of each throughput measurement (the median is reported)."""
    big: DecoderConfig
    """The model of the step-time ratio (about 1B parameters on a GPU)."""
    big_batch: int
    """Sequences per step of the step-time ratio."""
    rounds: int
    """Interleaved rounds of the step-time ratio (each: 10 plain and 10 guarded steps)."""
    ratio_budget_s: float
    """No new round of the step-time ratio starts after this many seconds of rounds."""


def gpu_settings(rounds: int) -> CheckSettings:
    return CheckSettings(
        device="cuda",
        multi_backend="gloo",
        single_backend="nccl",
        ranks=3,
        small=DecoderConfig(vocab=512, d_model=128, n_layers=2, n_heads=4, seq_len=128),
        small_batch=4,
        steps=10,
        verify_every=4,
        fault_onset=5,
        save_at=4,
        dropout=0.1,
        tensor_bytes=4 * 2**30,
        repeats=10,
        # 16 layers x (4 d^2 attention + 3 d x 5464 SwiGLU) + 2 x 32000 x d embeddings: 0.94e9.
        big=DecoderConfig(vocab=32000, d_model=2048, n_layers=16, n_heads=16, seq_len=1024),
        big_batch=8,
        rounds=rounds,
        ratio_budget_s=150.0,
    )


def tiny_settings(rounds: int) -> CheckSettings:
    """The GPU run's schedule (steps, onset, periods, ranks) on a tiny model on the CPU."""
    tiny = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    return replace(
        gpu_settings(rounds),
        device="cpu",
        single_backend="gloo",
        small=tiny,
        tensor_bytes=8 * 2**20,
        repeats=3,
        big=tiny,
        big_batch=4,
        ratio_budget_s=10.0,
    )
