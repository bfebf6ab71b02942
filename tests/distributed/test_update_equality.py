"""The guard never changes what the model learns: the weights after 12 guarded steps (verify
every 5) equal the plain DDP loop's, for the loss normalisations real jobs use."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig, LossSum, current_pass, is_replaying
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import (
    DecoderConfig,
    make_model,
    padded_batch,
    token_mean_loss,
    token_sum_loss,
)

TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
STEPS = 12


def _sample_mean(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over samples of each sample's own token mean (samples weigh the same)."""
    logits = module(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    per_sample = per_token.sum(1) / (labels != -100).sum(1)
    return per_sample.mean()


def _sample_sum(module: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    logits = module(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return LossSum(total=(per_token.sum(1) / (labels != -100).sum(1)).sum(), count=labels.shape[0])


def _token_sum_plain(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return token_sum_loss(module, batch).total


LOSSES: dict[str, Any] = {
    "sample_mean": _sample_mean,
    "sample_sum": _sample_sum,
    "token_mean": token_mean_loss,
    "token_sum": token_sum_loss,
    "sum": _token_sum_plain,
}


def _microbatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(batch, vals)) for vals in zip(*(v.chunk(n) for v in batch.values()))]


def _plain_step(model: nn.Module, reference: str, mbs: list[dict[str, torch.Tensor]]) -> None:
    """The user's own loop: one backward, or token-mean gradient accumulation over ``mbs`` that
    divides by the step's token count once, before the last backward (dividing each part
    instead rounds differently, and AdamW turns that into ~2e-5 relative after 12 steps)."""
    if len(mbs) == 1:
        LOSSES[reference](model, mbs[0]).backward()
        return
    assert reference == "token_mean", "accumulation is written for the token mean"
    tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            total = token_sum_loss(model, mb).total
            if last:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(1.0 / tokens)
                total = total * (1.0 / tokens)
            total.backward()


def _job(
    ctx: RankContext, reference: str, micro: int, variants: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """The plain DDP loop on ``reference``, then each guarded variant; weight differences back."""
    torch.set_num_threads(1)

    def fresh() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        ddp = DistributedDataParallel(make_model(TINY, seed=0))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    plain, opt = fresh()
    start = {k: v.clone() for k, v in plain.module.state_dict().items()}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _plain_step(
            plain, reference, _microbatches(padded_batch(TINY, step=s, rank=ctx.rank, batch=6), micro)
        )
        opt.step()
    want = plain.module.state_dict()
    out: dict[str, Any] = {}
    for name, cfg in variants:
        model, opt = fresh()
        split_steps: set[int] = set()

        def seen(_m: nn.Module, _i: Any, _o: Any, acc: set[int] = split_steps) -> None:
            if current_pass() == "probe" and not is_replaying():
                from replicheck.guard import current_step

                acc.add(current_step())

        model.module.embed.register_forward_hook(seen)
        guard = Guard(
            model,
            opt,
            LOSSES[name],
            config=GuardConfig(verify_every=5, weights_every=5, **cfg),
            node=ctx.node,
        )
        for s in range(STEPS):
            guard.step(*_microbatches(padded_batch(TINY, step=s, rank=ctx.rank, batch=6), micro))
        got = model.module.state_dict()
        # Relative to the whole model's weights (the worst single tensor is reported too).
        diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
        rel = float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())
        worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
        trained = max(float((want[k] - start[k]).norm() / want[k].norm()) for k in want)
        out[f"{name}/{micro}/{sorted(cfg.items())}"] = {
            "rel": rel,
            "worst_tensor": worst,
            "trained": trained,
            "split": sorted(split_steps),
        }
    return out


def _run(reference: str, variants: list[tuple[str, dict[str, Any]]], micro: int = 1) -> dict[str, Any]:
    results = run_local(_job, node_names(2, 1), args=(reference, micro, variants), timeout=240)
    return results[0]  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
def test_token_mean_with_padding_applies_the_unguarded_update() -> None:
    """HF causal-LM token mean with padding: a LossSum splits exactly (also over micro-batches,
    against the user's own accumulation loop), and the same loss as a plain mean falls back to an
    extra probe even when split is asked for; all match the plain loop."""
    out = _run("token_mean", [("token_sum", {}), ("token_mean", {}), ("token_mean", {"probe": "split"})])
    out |= _run("token_mean", [("token_sum", {})], micro=2)
    print(out)
    for key, r in out.items():
        assert r["rel"] <= 1e-6, (key, r)
        assert r["trained"] > 1e-3, "the model must actually move"
    assert out["token_sum/2/[]"]["split"] == [5, 10]
    assert out["token_sum/1/[]"]["split"] == [5, 10], "a LossSum loss must use the split probe"
    assert out["token_mean/1/[]"]["split"] == [], "a plain mean loss of unknown kind must not split"


@pytest.mark.timeout(300)
def test_per_sample_mean_applies_the_unguarded_update() -> None:
    """A per-sample mean declared in GuardConfig, or stated as a LossSum over samples, splits
    exactly."""
    out = _run(
        "sample_mean",
        [("sample_mean", {"loss_reduction": "sample_mean"}), ("sample_sum", {})],
    )
    print(out)
    for key, r in out.items():
        assert r["rel"] <= 1e-6, (key, r)
    assert out["sample_mean/1/[('loss_reduction', 'sample_mean')]"]["split"] == [0, 5, 10]


@pytest.mark.timeout(300)
def test_sum_loss_applies_the_unguarded_update() -> None:
    """A sum-reduced loss: undeclared it falls back to an extra probe, declared it splits; both
    match the plain loop."""
    out = _run("sum", [("sum", {}), ("sum", {"loss_reduction": "sum"})])
    print(out)
    for key, r in out.items():
        assert r["rel"] <= 1e-6, (key, r)
    assert out["sum/1/[('loss_reduction', 'sum')]"]["split"] == [0, 5, 10]
    assert out["sum/1/[]"]["split"] == []
