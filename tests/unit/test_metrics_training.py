"""Training-side per-rank counters around a real (world size 1) guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from replicheck.guard import CorruptionDetected, Guard, GuardConfig, current_pass
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch
from replicheck.metrics_training import TrainingMetrics

pytestmark = pytest.mark.timeout(120)
TINY = DecoderConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, seq_len=8)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_counts_steps_verifications_and_mismatches(tmp_path: Path) -> None:
    """Ten steps verifying every other one count 5 plain and 5 verified; a caught fault counts one
    mismatch under its check and still raises; the textfile parses as Prometheus text with the
    counts (plus one recorded replica check)."""
    model = make_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = Guard(
        model, opt, lm_loss, config=GuardConfig(verify_every=2, loss_reduction="sample_mean"), node="solo"
    )
    ticks = iter(float(i) for i in range(1000))
    metrics = TrainingMetrics(job_id="j", rank=0, clock=lambda: next(ticks))
    for s in range(10):
        metrics.step(guard, synthetic_batch(TINY, step=s, rank=0, batch=4))
    ffn = model.blocks[0].ffn
    assert isinstance(ffn, torch.nn.Module)
    ffn.register_forward_hook(lambda m, i, out: out + 1.0 if current_pass() == "probe" else None)
    with pytest.raises(CorruptionDetected):
        metrics.step(guard, synthetic_batch(TINY, step=10, rank=0, batch=4))
    snap = metrics.snapshot()
    assert snap["steps"] == {"plain": 5, "verified": 5}
    assert snap["replica_checks"] == 0  # one replica: nothing to compare across
    metrics.record_step(verified=False, replicas_checked=True, seconds=0.5)
    assert snap["mismatches"] == {"replay": 1}
    assert snap["step_seconds"] == {"plain": 5.0, "verified": 5.0, "stopped": 1.0}  # one tick per step
    path = tmp_path / "rank0.prom"
    metrics.write_textfile(path)
    m = _samples(path.read_text())
    labels = (("job", "j"), ("kind", "verified"), ("rank", "0"))
    assert m[("replicheck_training_steps_total", labels)] == 5
    assert (
        m[("replicheck_training_mismatches_total", (("check", "replay"), ("job", "j"), ("rank", "0")))] == 1
    )
    assert m[("replicheck_training_replica_checks_total", (("job", "j"), ("rank", "0")))] == 1
    assert (
        m[("replicheck_training_step_seconds_total", (("job", "j"), ("kind", "plain"), ("rank", "0")))] == 5.5
    )


def test_invalid_identity_refused() -> None:
    """An empty job id or a negative rank is a ValueError, not a mislabelled series."""
    with pytest.raises(ValueError):
        TrainingMetrics(job_id="", rank=0)
    with pytest.raises(ValueError):
        TrainingMetrics(job_id="j", rank=-1)
