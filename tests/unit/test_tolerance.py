"""Tolerant mode's tolerances by precision, the precision learnt from the first forward, the
cross-rank calibration and the guard's state (one process, no collectives but the loopback)."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from replicheck.guard import Guard, GuardConfig
from replicheck.guard.attribution.calibration import Calibration, cross_rank_noise
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.errors import GuardConfigError, GuardMisuseError
from replicheck.guard.step.precision import ToleranceState
from replicheck.guard.tolerance import TABLES, choose
from replicheck.harness.workloads import DecoderConfig, TinyDecoder, lm_loss, lm_loss_bf16

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:replicheck. world size 1")]


def test_defaults_come_from_the_table_of_the_precision() -> None:
    """With nothing set, block, floor and ceiling are the measured table's for the precision."""
    for precision, row in TABLES.items():
        tol, problems = choose(precision, sketch_block=None, floor=None, ceiling=None)
        assert (tol.sketch_block, tol.floor, tol.ceiling) == (row.sketch_block, row.floor, row.ceiling)
        assert tol.chosen == ("sketch_block", "floor", "ceiling") and not problems
        # The floor sits above the largest noise measured for the precision, the ceiling above it.
        assert row.measured_noise < row.floor <= row.ceiling


def test_a_ceiling_the_measured_noise_can_exceed_is_warned_with_the_figure() -> None:
    """A set ceiling (or floor) below the measured bf16 noise is kept, with a warning naming it."""
    noise = TABLES["bf16"].measured_noise
    tol, problems = choose("bf16", sketch_block=None, floor=None, ceiling=1e-2)
    assert tol.ceiling == 1e-2 and tol.floor == 1e-2  # the table's floor lowered to meet it
    assert any("tolerance_ceiling 0.01" in p and f"{noise:.3g}" in p for p in problems)
    _, problems = choose("bf16", sketch_block=None, floor=1e-5, ceiling=None)
    assert any("tolerance_floor 1e-05" in p for p in problems)
    _, problems = choose("fp32", sketch_block=None, floor=None, ceiling=None)
    assert not problems


def test_config_refuses_bad_tolerances_and_precisions() -> None:
    """Bad tolerant-mode fields are refused when the config is made."""
    for bad in (
        {"tolerance_floor": 1.0, "tolerance_ceiling": 0.1},
        {"tolerance_floor": 0.0},
        {"tolerance_ceiling": math.inf},
        {"sketch_block": 0},
        {"sketch_block": True},
        {"precision": "fp8"},
    ):
        with pytest.raises(GuardConfigError):
            GuardConfig(mode="tolerant", **bad)  # type: ignore[arg-type]


def _model(dtype: torch.dtype = torch.float32) -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(DecoderConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, seq_len=8)).to(dtype)


def _state(model: torch.nn.Module, **cfg: object) -> ToleranceState:
    config = GuardConfig(mode="tolerant", **cfg)  # type: ignore[arg-type]
    return ToleranceState(config, model, torch.device("cpu"), list(model.parameters()), rank=0)


def test_the_precision_is_learnt_from_the_first_forward() -> None:
    """Autocast bf16 in the first forward, bf16 parameters, or neither: bf16, bf16, fp32; the
    hooks are gone after the first forward."""
    tokens = torch.randint(0, 32, (2, 8))
    model = _model()
    state = _state(model)
    assert state.precision is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert state.precision == "bf16" and state.tolerance().sketch_block == TABLES["bf16"].sketch_block
    assert not model._forward_pre_hooks and not model._forward_hooks

    half = _model(torch.bfloat16)
    state = _state(half)
    half(tokens)
    assert state.precision == "bf16"

    plain = _model()
    state = _state(plain)
    plain(tokens)
    assert state.precision == "fp32" and state.tolerance().floor == TABLES["fp32"].floor


def test_a_set_precision_is_used_and_announced_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """``precision="bf16"`` needs no forward; the choice and the smallest change are logged."""
    with caplog.at_level(logging.INFO, logger="replicheck.guard"):
        state = _state(_model(), precision="bf16")
    assert state.precision == "bf16"
    text = caplog.text
    assert "tolerant mode (bf16): sketch block 256, floor 0.08" in text and "Smallest change" in text


def test_ranks_in_different_precisions_are_a_misuse() -> None:
    """Rows reporting different precisions raise GuardMisuseError (the same on every rank)."""
    state = _state(_model(), precision="bf16")
    assert state.agreed([3, 3, 3]).precision == "bf16"
    assert state.agreed([1, 1]).precision == "fp32"
    with pytest.raises(GuardMisuseError, match="rank 1: fp32"):
        state.agreed([3, 1, 3])


def test_cross_rank_noise_ignores_one_faulty_rank_and_sees_noise_every_pair_has() -> None:
    """A rank with a fault from step 0 makes its two pairs loud: it does not raise the cross-rank
    noise. Noise every pair shares (every node different) does. Two ranks: not measured."""
    ring = Ring.build(["a", "b", "c", "d"])
    clean = [1e-6] * 4
    faulty = list(clean)
    f = 2
    faulty[f] = 0.5  # the pair rank 2 verified
    faulty[ring.verifier_of(f)] = 0.5  # the pair that verified rank 2
    assert cross_rank_noise(faulty, ring) == pytest.approx(1e-6)
    assert cross_rank_noise([3e-3] * 4, ring) == pytest.approx(3e-3)
    ring3 = Ring.build(["a", "b", "c"])
    three = [1e-6, 1e-6, 1e-6]
    three[1] = 0.5
    three[ring3.verifier_of(1)] = 0.5
    assert cross_rank_noise(three, ring3) == pytest.approx(1e-6)
    assert cross_rank_noise([0.5, 0.5], Ring.build(["a", "b"])) == 0.0


def test_calibration_folds_both_noises_and_clamps_the_threshold() -> None:
    """The threshold is the margin over the louder of same-device and cross-rank noise, between
    floor and ceiling; non-finite measurements do not calibrate."""
    ring = Ring.build(["a", "b", "c"])
    cal = Calibration().fold([1e-6, 2e-6, 3e-6], [5e-6] * 3, ring)
    assert (cal.verifications, cal.same_device, cal.cross_rank) == (1, 2e-6, 5e-6)
    assert cal.threshold(margin=10, floor=1e-5, ceiling=1e-2) == pytest.approx(5e-5)
    assert cal.threshold(margin=10, floor=1e-4, ceiling=1e-2) == 1e-4
    assert (
        Calibration().fold([1.0] * 3, [1.0] * 3, ring).threshold(margin=10, floor=1e-4, ceiling=1e-2) == 1e-2
    )
    assert Calibration().fold([math.inf] * 3, [math.nan] * 3, ring).noise == 0.0
    assert Calibration.from_dict(cal.to_dict()) == cal
    for bad in (
        {},
        {"verifications": -1, "same_device": 0, "cross_rank": 0},
        {**cal.to_dict(), "cross_rank": math.nan},
    ):
        with pytest.raises(ValueError):
            Calibration.from_dict(bad)


def _guard(loss=lm_loss, **cfg: object) -> tuple[Guard, TinyDecoder]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(mode="tolerant", verify_every=1, **cfg)  # type: ignore[arg-type]
    return Guard(model, opt, loss, config=config, node="solo"), model


def test_the_guard_saves_and_restores_its_calibration() -> None:
    """state_dict holds steps and calibration; a new guard loaded with it continues from them and
    does not calibrate again; a bad state is refused and changes nothing."""
    tokens = torch.randint(0, 32, (2, 9))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    guard, _ = _guard(loss=lm_loss_bf16)
    for _ in range(4):
        guard.step(batch)
    state = guard.state_dict()
    assert state["next_step"] == 4 and state["last_verified_step"] == 3
    assert state["calibration"]["verifications"] == 3
    assert guard.tolerance is not None and guard.tolerance.precision == "bf16"

    other, _ = _guard(loss=lm_loss_bf16)
    for bad in ({}, {**state, "next_step": -1}, {**state, "calibration": {"verifications": "x"}}):
        with pytest.raises(GuardConfigError):
            other.load_state_dict(bad)  # type: ignore[arg-type]
    assert other.next_step == 0 and other.state_dict()["calibration"]["verifications"] == 0
    other.load_state_dict(state)
    assert other.next_step == 4 and other.last_verified_step == 3
    assert other.state_dict()["calibration"] == state["calibration"]
    other.step(batch)
    assert other.state_dict()["calibration"]["verifications"] == 3  # kept, not measured again


def test_exact_mode_has_no_tolerance_and_installs_no_hook() -> None:
    """Exact mode learns nothing of the precision: no hooks, no tolerance."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, node="solo")
    assert guard.tolerance is None and guard.threshold is None
    assert not model._forward_pre_hooks and not model._forward_hooks
