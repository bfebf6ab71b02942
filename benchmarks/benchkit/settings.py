"""The shapes and budgets of ``gpu_check.py``: the full GPU run and its ``--tiny`` CPU twin."""

from __future__ import annotations

from dataclasses import dataclass, replace

from replicheck.harness.workloads import DecoderConfig


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    """Everything that differs between the GPU run and ``--tiny``; the code paths are the same."""

    device: str
    """``cuda`` or ``cpu``."""
    backend: str
    """Backend of every part's world-size-1 process group (``nccl`` on a GPU, ``gloo`` on the CPU)."""
    small: DecoderConfig
    """The small Llama-style decoder of the guarded loops (parts a and b)."""
    small_batch: int
    """Sequences per step of the guarded loops."""
    loop_steps: int
    """Steps of each guarded loop of part a (every one a verification)."""
    nan_step: int
    """Step whose gradient gets the NaN in part b (an ordinary step: verify every 2, from step 0)."""
    sdpa_shape: tuple[int, int, int, int]
    """(batch, heads, tokens, head dim) of the attention backward of part c."""
    embedding: tuple[int, int]
    """(rows, width) of the embedding table of part c."""
    linear: tuple[int, int, int]
    """(tokens, in, out) of the bf16 ``linear`` of part c."""
    probe_model: DecoderConfig
    """The decoder of part d (its ``seq_len`` is replaced by each length of ``probe_tokens``)."""
    probe_tokens: tuple[int, ...]
    """Sequence lengths (one sequence) of part d."""
    big: DecoderConfig
    """The ~1B-parameter decoder of parts e and f (tiny on the CPU)."""
    big_batch: int
    """Sequences per step of part f."""
    overhead_steps: int
    """Back-to-back steps per loop of part f (one synchronisation at the end)."""
    overhead_rounds: int
    """Plain/guarded loop pairs of part f (interleaved)."""
    repeats: int
    """Timed repetitions of each fingerprint measurement of part e (the median is reported)."""


def gpu_settings() -> CheckSettings:
    return CheckSettings(
        device="cuda",
        backend="nccl",
        small=DecoderConfig(vocab=512, d_model=128, n_layers=2, n_heads=4, seq_len=128),
        small_batch=4,
        loop_steps=6,
        nan_step=3,
        sdpa_shape=(2, 16, 2048, 64),
        embedding=(32000, 1024),
        linear=(4096, 4096, 4096),
        # At 8K tokens the math backend's attention matrix is 16 heads x 8K x 8K x 4 B = 4 GiB a layer.
        probe_model=DecoderConfig(vocab=32000, d_model=1024, n_layers=4, n_heads=16, seq_len=4096),
        probe_tokens=(4096, 8192),
        # 16 layers x (4 d^2 attention + 3 d x 5464 SwiGLU) + 2 x 32000 x d embeddings: 0.94e9.
        big=DecoderConfig(vocab=32000, d_model=2048, n_layers=16, n_heads=16, seq_len=1024),
        big_batch=4,
        overhead_steps=20,
        overhead_rounds=3,
        repeats=5,
    )


def tiny_settings() -> CheckSettings:
    """The GPU run's code paths and schedule on tiny shapes on the CPU."""
    tiny = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    return replace(
        gpu_settings(),
        device="cpu",
        backend="gloo",
        small=tiny,
        small_batch=2,
        loop_steps=3,
        sdpa_shape=(1, 2, 64, 16),
        embedding=(512, 16),
        linear=(32, 64, 64),
        probe_model=tiny,
        probe_tokens=(32, 64),
        big=tiny,
        big_batch=2,
        overhead_steps=20,
        overhead_rounds=1,
        repeats=2,
    )
