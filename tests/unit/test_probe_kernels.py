"""Kernel settings of deterministic probe passes: the attention backend option
(``GuardConfig.probe_attention``) and no NaN fill of uninitialised memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.deterministic
from torch import nn
from torch.profiler import profile

from replicheck.guard import Guard, GuardConfig, GuardConfigError, current_pass
from replicheck.guard.step.determinism import deterministic


def _backends() -> tuple[bool, bool, bool]:
    """(flash, memory-efficient, math) SDPA backends enabled right now."""
    return (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
    )


class _Attention(nn.Module):
    """Records the SDPA backends, the determinism flags and whether ``torch.empty`` is filled."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[tuple[str, tuple[bool, bool, bool], bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profile() as prof:
            torch.empty(64)
        fills = sum(e.count for e in prof.key_averages() if e.key == "aten::fill_")
        self.seen.append((current_pass(), _backends(), torch.are_deterministic_algorithms_enabled(), fills))
        q = self.proj(x).view(x.shape[0], 2, -1, 4)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).flatten(1).sum(-1)


def _loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]) - batch["y"]).square().mean()


def _seen(**cfg: Any) -> list[tuple[str, tuple[bool, bool, bool], bool, int]]:
    torch.manual_seed(0)
    model = _Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="world size 1"):
        guard = Guard(model, opt, _loss, config=GuardConfig(verify_every=1, **cfg), node="n0")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    guard.step({"x": x, "y": x.sum(-1)})
    return model.seen


@pytest.mark.parametrize("probe", ["split", "extra"])
def test_probe_attention_math_pins_sdpa_in_probe_passes_only(probe: str) -> None:
    """probe_attention="math" (the default): probe and replay passes see the math SDPA backend
    only; the training pass sees every backend the user left on."""
    seen = _seen(probe=probe, loss_reduction="sample_mean")
    assert {"probe", "replay", "train"} <= {p for p, *_ in seen}
    for pass_, backends, det, _ in seen:
        if pass_ in ("probe", "replay"):
            assert (backends, det) == ((False, False, True), True), pass_
        else:
            assert (backends, det) == ((True, True, True), False), pass_


@pytest.mark.parametrize("probe", ["split", "extra"])
def test_probe_attention_default_leaves_sdpa_to_torch(probe: str) -> None:
    """probe_attention="default": probe and replay passes run with deterministic algorithms on
    and every SDPA backend the user enabled (no pin to the math backend)."""
    seen = _seen(probe=probe, loss_reduction="sample_mean", probe_attention="default")
    assert {"probe", "replay"} <= {p for p, *_ in seen}
    for pass_, backends, det, _ in seen:
        assert backends == (True, True, True), pass_
        assert det == (pass_ in ("probe", "replay")), pass_


def test_probe_attention_default_keeps_the_users_backend_choice() -> None:
    """Under "default" the probe pass sees what the user chose (flash off here), not a forced set."""
    with deterministic(True, "default"), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert _backends() == (False, False, True)
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with deterministic(True, "default"):
            assert _backends() == (False, True, True)
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


@pytest.mark.parametrize("value", ["flash", "MATH", None, 1])
def test_probe_attention_rejects_other_values(value: object) -> None:
    """A probe_attention other than "math" or "default" is a GuardConfigError naming both."""
    with pytest.raises(GuardConfigError, match="probe_attention must be 'math' or 'default'"):
        GuardConfig(probe_attention=value)  # type: ignore[arg-type]


def test_deterministic_turns_off_the_nan_fill_and_restores_it() -> None:
    """Inside deterministic(True) torch does not fill uninitialised memory; the user's setting is
    back afterwards (also after an error), and deterministic(False) leaves it alone."""
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    with deterministic(True):
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    with pytest.raises(ValueError, match="boom"), deterministic(True):
        raise ValueError("boom")
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    with deterministic(False):
        assert torch.utils.deterministic.fill_uninitialized_memory is True


def test_torch_empty_in_a_probe_pass_is_not_filled() -> None:
    """A torch.empty in a probe or replay pass runs no fill_ kernel (counted by the profiler:
    torch's fill runs below the Python dispatcher, so a dispatch mode cannot see it)."""
    seen = _seen(probe="split", loss_reduction="sample_mean")
    probes = [fills for pass_, _, _, fills in seen if pass_ in ("probe", "replay")]
    assert probes and all(f == 0 for f in probes), seen
