"""Each fault site changes exactly what it says, on the chosen rank only, and is removable."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replicheck.faults import Fault, FaultConfigError, KernelNoise
from replicheck.guard.context import running
from replicheck.harness.workloads import lm_loss


def _grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int, pass_: Any = "train"
) -> dict[str, torch.Tensor]:
    with running(step, pass_):
        loss = lm_loss(model, batch)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return {n: g for (n, _), g in zip(model.named_parameters(), grads)}


def _output(model: torch.nn.Module, name: str, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    mod = dict(model.named_modules())[name]
    h = mod.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()), prepend=False)
    with running(step, "train"), torch.no_grad():
        model(batch["tokens"])
    h.remove()
    return seen[0]


@pytest.mark.timeout(60)
def test_forward_output_fault_changes_only_recorded_values(pair: Any, batch: Any) -> None:
    """A forward-output fault changes exactly the recorded positions of that module's output."""
    bad, good = pair
    handle = Fault.at_forward("blocks.0.ffn").persistent(from_step=2).bitflip(bit=22).install(bad, rank=0)
    assert torch.equal(_output(bad, "blocks.0.ffn", batch, 1), _output(good, "blocks.0.ffn", batch, 1))
    assert handle.records == []
    out_bad, out_good = _output(bad, "blocks.0.ffn", batch, 2), _output(good, "blocks.0.ffn", batch, 2)
    (rec,) = handle.records
    diff = (out_bad != out_good).reshape(-1).nonzero().flatten().tolist()
    assert diff == list(rec.positions) and rec.step == 2 and rec.pass_ == "train" and rec.bit == 22
    assert rec.old == (float(out_good.reshape(-1)[diff[0]]),) and rec.new == (
        float(out_bad.reshape(-1)[diff[0]]),
    )
    assert rec.tensor == "blocks.0.ffn.output"


@pytest.mark.timeout(60)
def test_matmul_fault_hits_forward_matmuls_only(pair: Any, batch: Any) -> None:
    """A matmul-class fault corrupts the matrix products inside the module's forward, not its backward."""
    bad, good = pair
    handle = Fault.at_forward("blocks.0.ffn", ops="matmul").persistent().scale(1000.0).install(bad, rank=0)
    g_bad, g_good = _grads(bad, batch, 0), _grads(good, batch, 0)
    names = [r.tensor for r in handle.records]
    assert len(names) == 3 and all(n.startswith("blocks.0.ffn:") and ("mm" in n) for n in names)
    assert not torch.equal(g_bad["head.weight"], g_good["head.weight"])
    with running(0, "train"), torch.no_grad():
        bad(batch["tokens"])  # the modes leave with the forward: nothing outside the module is hit
    assert len(handle.records) == 6


@pytest.mark.timeout(60)
def test_weight_gradient_fault_leaves_forward_and_other_grads_untouched(pair: Any, batch: Any) -> None:
    """A weight-gradient fault changes only that parameter's gradient, at the recorded chunk."""
    bad, good = pair
    name = "blocks.0.ffn.down.weight"
    handle = Fault.at_weight_gradient(name).transient(step=5).zero_chunk().install(bad, rank=0)
    with running(5, "train"), torch.no_grad():
        assert torch.equal(lm_loss(bad, batch), lm_loss(good, batch))
    g_bad, g_good = _grads(bad, batch, 5), _grads(good, batch, 5)
    (rec,) = handle.records
    for n in g_good:
        if n != name:
            assert torch.equal(g_bad[n], g_good[n]), n
    diff = (g_bad[name] != g_good[name]).reshape(-1).nonzero().flatten().tolist()
    assert set(diff) <= set(rec.positions) and len(rec.positions) == 32 and all(v == 0 for v in rec.new)
    g_again = _grads(bad, batch, 5)  # transient: one event only
    assert torch.equal(g_again[name], g_good[name]) and len(handle.records) == 1


@pytest.mark.timeout(60)
def test_optimizer_update_fault_changes_only_that_update(pair: Any, batch: Any) -> None:
    """An optimizer-update fault corrupts the recorded element of that parameter's update only."""
    bad, good = pair
    name = "head.weight"
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (bad, good)]
    handle = (
        Fault.at_optimizer_update(name).transient(step=0).scale(-50.0).install(bad, optimizer=opts[0], rank=0)
    )
    for m, o in zip((bad, good), opts):
        lm_loss(m, batch).backward()
        with running(0, "optimizer"):
            o.step()
    (rec,) = handle.records
    assert rec.pass_ == "optimizer" and rec.tensor == f"{name}.update"
    p_bad, p_good = dict(bad.named_parameters()), dict(good.named_parameters())
    for n in p_good:
        diff = (p_bad[n] != p_good[n]).reshape(-1).nonzero().flatten().tolist()
        assert diff == (list(rec.positions) if n == name else []), n
    assert rec.new[0] == pytest.approx(-50.0 * rec.old[0])


@pytest.mark.timeout(60)
def test_weights_at_rest_fault_flips_once_before_the_step(pair: Any, batch: Any) -> None:
    """A weights-at-rest fault flips the stored weight once, at the start of its step."""
    bad, good = pair
    name = "embed.weight"
    handle = Fault.at_weights(name).transient(step=3).bitflip(bit=20).install(bad, rank=0)
    _grads(bad, batch, 2)
    assert torch.equal(bad.embed.weight, good.embed.weight)
    _grads(bad, batch, 3)
    _grads(bad, batch, 3, "replay")
    (rec,) = handle.records
    assert rec.pass_ == "idle" and rec.step == 3
    xor = bad.embed.weight.detach().view(torch.int32) ^ good.embed.weight.detach().view(torch.int32)
    assert xor.reshape(-1).nonzero().flatten().tolist() == list(rec.positions)


@pytest.mark.timeout(60)
def test_fault_for_another_rank_is_inert_and_remove_uninstalls(pair: Any, batch: Any) -> None:
    """On a rank that is not the chosen one nothing is hooked; after remove() nothing changes."""
    bad, good = pair
    fault = Fault.at_forward("head").persistent().nan().on_rank(1)
    other = fault.install(bad, rank=0)
    assert not other.active
    assert torch.equal(_output(bad, "head", batch, 0), _output(good, "head", batch, 0))
    mine = fault.install(bad, rank=1)
    assert _output(bad, "head", batch, 0).isnan().any()
    mine.remove()
    assert torch.equal(_output(bad, "head", batch, 1), _output(good, "head", batch, 1))
    assert len(mine.records) == 1 and other.records == []


@pytest.mark.timeout(60)
def test_passes_filter_and_seed_reproducibility(pair: Any, batch: Any) -> None:
    """only_in() limits the passes hit; the same seed corrupts the same positions."""
    bad, good = pair
    fault = (
        Fault.at_forward("blocks.0.attn").persistent().bitflip(field="mantissa").only_in("probe").seeded(11)
    )
    h1 = fault.install(bad, rank=0)
    _output(bad, "blocks.0.attn", batch, 0)
    assert h1.records == []
    with running(0, "probe"), torch.no_grad():
        bad(batch["tokens"])
    h2 = fault.install(good, rank=0)
    with running(0, "probe"), torch.no_grad():
        good(batch["tokens"])
    assert [(r.positions, r.bit) for r in h1.records] == [(r.positions, r.bit) for r in h2.records]


@pytest.mark.timeout(60)
def test_kernel_noise_uses_its_own_generator(pair: Any, batch: Any) -> None:
    """Simulated kernel noise differs call to call, even under the same global seed."""
    bad, _ = pair
    KernelNoise(module="norm", rel=1e-5, seed=1).install(bad)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(bad(batch["tokens"]))
    assert not torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[1], rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(30)
def test_unknown_names_and_missing_parts_raise(pair: Any) -> None:
    """Unknown modules/parameters, or a site lacking its optimizer/guard, raise FaultConfigError."""
    bad, _ = pair
    for fault in (
        Fault.at_forward("nope"),
        Fault.at_weight_gradient("nope"),
        Fault.at_optimizer_update("head.weight"),
        Fault.at_reduced_gradient(),
        Fault(),
    ):
        with pytest.raises(FaultConfigError):
            fault.install(bad, rank=0)
