"""A small Llama-style decoder and reproducible synthetic data, for tests, demos and benchmarks.

The data of a step is a pure function of (seed, step, rank), so a resumed job sees exactly the
batches an uninterrupted one would have seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from replicheck.guard.loss import LossSum


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shape of :class:`TinyDecoder`."""

    vocab: int = 256
    """Vocabulary size."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads (``d_model`` must be divisible by it)."""
    seq_len: int = 32
    """Tokens per sequence."""
    ffn_mult: float = 8 / 3
    """Hidden width of the SwiGLU feed-forward as a multiple of ``d_model``."""
    checkpointing: Literal["none", "reentrant", "non_reentrant"] = "none"
    """Activation checkpointing of each block (``torch.utils.checkpoint``)."""


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = _apply_rotary(q, cos[:t], sin[:t]), _apply_rotary(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        hidden = int(math.ceil(cfg.d_model * cfg.ffn_mult / 8) * 8)
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class TinyDecoder(nn.Module):
    """Llama-style decoder: RMSNorm, rotary attention, SwiGLU, untied output head."""

    def __init__(self, cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or DecoderConfig()
        c = self.cfg
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        cos, sin = _rotary(c.seq_len, c.d_model // c.n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.cfg.checkpointing == "none":
                x = block(x, self.cos, self.sin)
            else:
                reentrant = self.cfg.checkpointing == "reentrant"
                x = checkpoint(block, x, self.cos, self.sin, use_reentrant=reentrant)
        return self.head(self.norm(x))


def lm_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy; the ``loss_fn`` the guard calls."""
    logits = module(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def make_model(cfg: DecoderConfig | None = None, seed: int = 0) -> TinyDecoder:
    """A decoder whose initial weights depend only on ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyDecoder(cfg)


def synthetic_batch(
    cfg: DecoderConfig, *, step: int, rank: int, batch: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a learnable pattern (each token predicts the next by a
    fixed affine rule with noise), reproducible from its arguments alone."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 7, (batch, 1), generator=gen)
    pos = torch.arange(cfg.seq_len + 1).unsqueeze(0)
    seq = (start + stride * pos) % cfg.vocab
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, cfg.vocab, seq.shape, generator=gen), seq)
    return {"tokens": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}


def padded_batch(
    cfg: DecoderConfig, *, step: int, rank: int, batch: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A Hugging Face causal-LM shaped batch: ``input_ids`` and ``labels`` with ``-100`` on the
    padding, each sequence of its own length (so token counts differ per sample and per rank)."""
    full = synthetic_batch(cfg, step=step, rank=rank, batch=batch, seed=seed)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 8191 + rank)
    lengths = torch.randint(2, cfg.seq_len + 1, (batch, 1), generator=gen)
    real = torch.arange(cfg.seq_len).unsqueeze(0) < lengths
    ids = torch.where(real, full["tokens"], 0)
    return {"input_ids": ids, "labels": torch.where(real, ids, -100)}


def _shifted_logits(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = module(batch["input_ids"])[:, :-1]
    return logits.flatten(0, 1), batch["labels"][:, 1:].flatten()


def token_mean_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Hugging Face causal-LM loss: mean cross-entropy over non-padding next tokens."""
    logits, labels = _shifted_logits(module, batch)
    return F.cross_entropy(logits, labels, ignore_index=-100)


def token_sum_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """The same loss as :func:`token_mean_loss` stated as a sum with its token count, which lets
    the guard split a probe off the batch and still apply exactly the unsplit update."""
    logits, labels = _shifted_logits(module, batch)
    total = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return LossSum(total=total, count=(labels != -100).sum())


def lm_loss_bf16(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`lm_loss` with the forward under bf16 autocast (the loss itself in fp32)."""
    return _autocast_lm_loss(module, batch, torch.bfloat16)


def lm_loss_fp16(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`lm_loss` with the forward under fp16 autocast (trained with a loss scaler)."""
    return _autocast_lm_loss(module, batch, torch.float16)


def _autocast_lm_loss(module: nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    device = next(module.parameters()).device.type
    with torch.autocast(device_type=device, dtype=dtype):
        logits = module(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
