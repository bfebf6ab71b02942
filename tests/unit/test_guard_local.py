"""The guard with world size 1, its configuration and its batch handling."""

from __future__ import annotations

import pytest
import torch

from replicheck import EXIT_CORRUPTION, is_replaying
from replicheck.guard import (
    BatchError,
    CorruptionDetected,
    Guard,
    GuardConfig,
    GuardConfigError,
    GuardMisuseError,
    current_pass,
)
from replicheck.guard.transport.batch import batch_size, split
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

pytestmark = pytest.mark.timeout(60)
TINY = DecoderConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, seq_len=8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"verify_every": 0},
        {"mode": "fuzzy"},
        {"probe": "half"},
        {"probe_size": 0},
        {"tolerance_floor": 1.0, "tolerance_ceiling": 0.1},
        {"weights_every": -1},
    ],
)
def test_invalid_config_raises_typed_error(kwargs: dict) -> None:
    """Each invalid setting raises GuardConfigError rather than failing later."""
    with pytest.raises(GuardConfigError):
        GuardConfig(**kwargs)


def test_batch_must_share_dimension_zero() -> None:
    """Leaves with different sample counts are refused with BatchError."""
    with pytest.raises(BatchError):
        batch_size({"a": torch.zeros(3, 2), "b": torch.zeros(4)})
    head, tail = split({"a": torch.arange(5), "n": 3}, 2)
    assert head["a"].tolist() == [0, 1] and tail["a"].tolist() == [2, 3, 4] and tail["n"] == 3


def test_single_process_guard_trains_and_replays_without_side_effects() -> None:
    """World size 1: steps verify, replays see is_replaying(), and the loss goes down."""
    model = make_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen: list[tuple[str, bool]] = []
    model.embed.register_forward_hook(lambda m, i, o: seen.append((current_pass(), is_replaying())))
    guard = Guard(
        model, opt, lm_loss, config=GuardConfig(verify_every=2, loss_reduction="sample_mean"), node="solo"
    )
    losses = [guard.step(synthetic_batch(TINY, step=s, rank=0, batch=4)).loss for s in range(30)]
    assert ("replay", True) in seen and ("train", False) in seen and ("probe", False) in seen
    assert sum(losses[-5:]) < sum(losses[:5])
    assert guard.last_verified_step == 28 and guard.next_step == 30


def test_single_process_transient_fault_is_caught_and_update_withheld(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """World size 1 catches a fault that hits only its own probe pass, and applies nothing."""
    model = make_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def hook(m, i, out):  # type: ignore[no-untyped-def]
        return out + 1.0 if current_pass() == "probe" else None

    model.blocks[0].ffn.register_forward_hook(hook)
    guard = Guard(
        model,
        opt,
        lm_loss,
        config=GuardConfig(verify_every=1, incident_dir=str(tmp_path), job_id="j"),
        node="solo",
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptionDetected) as err:
        guard.step(synthetic_batch(TINY, step=0, rank=0, batch=4))
    inc = err.value.incident
    assert inc.check == "replay" and inc.step == 0
    assert (tmp_path / "j-s0-replay.json").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert guard.next_step == 0
    assert EXIT_CORRUPTION not in (0, 1, 2) and EXIT_CORRUPTION < 128


def test_a_live_guard_loads_another_guards_state_at_a_step_boundary() -> None:
    """A guard that has already stepped takes another guard's state between two steps (torchft's
    live recovery): its next step is the loaded one, and the verification schedule follows it;
    a load from inside a step (here the loss function) is refused and changes nothing."""
    model = make_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = Guard(model, opt, lm_loss, config=GuardConfig(verify_every=2), node="solo")
    for s in range(2):
        guard.step(synthetic_batch(TINY, step=s, rank=0, batch=4))
    other = make_model(TINY)
    source = Guard(other, torch.optim.AdamW(other.parameters()), lm_loss, node="solo")
    source.load_state_dict({**source.state_dict(), "next_step": 7, "last_verified_step": 6})
    guard.load_state_dict(source.state_dict())
    assert (guard.next_step, guard.last_verified_step) == (7, 6)
    odd = guard.step(synthetic_batch(TINY, step=7, rank=0, batch=4))
    even = guard.step(synthetic_batch(TINY, step=8, rank=0, batch=4))
    assert (odd.step, odd.verified, even.step, even.verified) == (7, False, 8, True)
    assert guard.last_verified_step == 8

    state = guard.state_dict()
    during: list[Guard] = []

    def reloading(module: torch.nn.Module, batch: dict) -> torch.Tensor:
        during[0].load_state_dict({**state, "next_step": 100})
        return lm_loss(module, batch)

    during.append(Guard(model, opt, reloading, config=GuardConfig(verify_every=2), node="solo"))
    during[0].load_state_dict(state)
    with pytest.raises(GuardMisuseError, match="during guard.step"):
        during[0].step(synthetic_batch(TINY, step=9, rank=0, batch=4))
    assert during[0].next_step == 9
