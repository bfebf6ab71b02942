"""Simulated kernel noise: each shape perturbs a module's output the way it says, from the rank's
own generator, on the ranks it names; a rank bias is a constant; bad fields are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replicheck.faults import FaultConfigError, KernelNoise, RankBias, install_noise

pytestmark = pytest.mark.timeout(60)


class _Copy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _Net(torch.nn.Module):
    """A model whose module ``norm`` hands back a copy of its input: the hook's change is the
    output minus the input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _Copy()
        self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _x(n: int = 100_000, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _run(noise: Any, x: torch.Tensor, rank: int = 0, calls: int = 1) -> list[torch.Tensor]:
    net = _Net()
    noise.install(net, rank=rank)
    return [net(x) for _ in range(calls)]


def test_gaussian_default_is_the_relative_noise_it_always_was() -> None:
    """The default shape is ``out · (1 + rel · N(0,1))`` drawn in the output's dtype from the
    generator seeded ``seed · 7919 + rank``: the draws the earlier soaks used."""
    x = _x(1000)
    (out,) = _run(KernelNoise(module="norm", rel=1e-3, seed=5), x, rank=2)
    gen = torch.Generator().manual_seed(5 * 7919 + 2)
    expected = x * (1 + 1e-3 * torch.randn(x.shape, generator=gen, dtype=x.dtype))
    assert torch.equal(out, expected)


def test_additive_noise_scales_with_the_mean_absolute_value() -> None:
    """Additive noise is ``rel · mean|out| · N(0,1)``: the same draws on a 100× larger output
    move it 100× as far, and the spread in units of ``rel · mean|out|`` is about 1."""
    noise = KernelNoise(module="norm", rel=1e-3, seed=1, shape="additive")
    x = _x(dtype=torch.float64)
    (small,) = _run(noise, x)
    (large,) = _run(noise, 100 * x)
    d_small, d_large = small - x, large - 100 * x
    assert torch.allclose(d_large, 100 * d_small, rtol=1e-6, atol=0)
    spread = float(d_small.std() / (1e-3 * x.abs().mean()))
    assert 0.97 < spread < 1.03
    # Near-zero values move by the same absolute amount, so a lot relative to themselves.
    tiny = x.abs() < 1e-3
    assert float((d_small[tiny] / x[tiny]).abs().median()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_noise_moves_about_fraction_of_values_by_exactly_one_ulp(dtype: torch.dtype) -> None:
    """``ulp`` moves about ``fraction`` of the values, each to its neighbour in the dtype (up or
    down, both seen), and leaves the rest bit for bit."""
    x = _x(dtype=dtype)
    (out,) = _run(KernelNoise(module="norm", seed=3, shape="ulp", fraction=0.01), x)
    moved = out != x
    count = int(moved.sum())
    assert 800 < count < 1200  # 1,000 expected, σ ≈ 31
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    down = torch.nextafter(x, torch.full_like(x, -float("inf")))
    assert bool(((out[moved] == up[moved]) | (out[moved] == down[moved])).all())
    assert int((out[moved] == up[moved]).sum()) > 400 and int((out[moved] == down[moved]).sum()) > 400


def test_heavy_noise_is_bounded_by_the_clip_and_heavy_tailed() -> None:
    """``heavy`` adds ``rel · mean|out| · T``: never beyond ``clip`` units, and with df = 1 far
    more values beyond 5 units than a Gaussian gives (about 1e-6 of them)."""
    x = _x(dtype=torch.float64)
    (out,) = _run(KernelNoise(module="norm", rel=1e-4, seed=2, shape="heavy", df=1.0, clip=20.0), x)
    units = (out - x) / (1e-4 * x.abs().mean())
    assert float(units.abs().max()) <= 20.0 * (1 + 1e-9)
    assert float(units.abs().max()) > 19.0  # Cauchy draws reach the clip
    assert float((units.abs() > 5).double().mean()) > 0.05


@pytest.mark.parametrize("shape", ["gaussian", "additive", "ulp", "heavy"])
def test_noise_differs_call_to_call_under_the_same_global_seed(shape: Any) -> None:
    """Every shape draws from its own generator: seeding the global RNG before each pass (as the
    guard does for probes and replays) does not repeat the noise."""
    net = _Net()
    KernelNoise(module="norm", rel=1e-3, seed=1, shape=shape, fraction=0.1).install(net)
    x = _x(1000)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(net(x))
    assert not torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], x)


def test_noise_and_bias_act_only_on_their_ranks() -> None:
    """A noise model with ``ranks`` is a no-op elsewhere (its remover too); on a listed rank it
    acts and its remover takes it out."""
    x = _x(1000)
    for model in (
        KernelNoise(module="norm", rel=1e-3, seed=1, ranks=(1, 3)),
        RankBias(module="norm", ranks=(1, 3)),
    ):
        net = _Net()
        remove = model.install(net, rank=2)
        assert torch.equal(net(x), x)
        remove()
        remove = model.install(net, rank=3)
        assert not torch.equal(net(x), x)
        remove()
        assert torch.equal(net(x), x)


def test_rank_bias_is_a_constant_scale() -> None:
    """``RankBias`` multiplies the output by ``1 + scale`` on every pass, with no randomness."""
    x = _x(1000)
    first, second = _run(RankBias(module="norm", scale=1e-3, ranks=(0,)), x, calls=2)
    assert torch.equal(first, x * (1 + 1e-3))
    assert torch.equal(first, second)


def test_install_noise_chains_and_removes_every_model() -> None:
    """``install_noise`` applies the models in order on the same module and one remover takes
    them all out; a refused model takes out those installed before it."""
    x = _x(1000)
    net = _Net()
    remove = install_noise(
        [RankBias(module="norm", scale=1e-3, ranks=(1,)), RankBias(module="norm", scale=1e-3, ranks=(1,))],
        net,
        rank=1,
    )
    assert torch.equal(net(x), x * (1 + 1e-3) * (1 + 1e-3))
    remove()
    assert torch.equal(net(x), x)
    with pytest.raises(FaultConfigError, match="nope"):
        install_noise([RankBias(module="norm", ranks=(0,)), KernelNoise(module="nope")], net, rank=0)
    assert torch.equal(net(x), x)


def test_non_floating_outputs_are_left_alone() -> None:
    """Integer outputs pass through every shape untouched."""
    ints = torch.arange(100)
    for shape in ("gaussian", "additive", "ulp", "heavy"):
        (out,) = _run(KernelNoise(module="norm", rel=1.0, seed=1, shape=shape, fraction=1.0), ints)  # type: ignore[arg-type]
        assert torch.equal(out, ints)


@pytest.mark.parametrize(
    "fields",
    [
        {"module": ""},
        {"module": "norm", "rel": -1e-6},
        {"module": "norm", "rel": float("nan")},
        {"module": "norm", "shape": "uniform"},
        {"module": "norm", "fraction": 0.0},
        {"module": "norm", "fraction": 1.5},
        {"module": "norm", "df": 0.0},
        {"module": "norm", "clip": -1.0},
        {"module": "norm", "ranks": (0, -1)},
        {"module": "norm", "ranks": ()},
        {"module": "norm", "ranks": (True,)},
        {"module": "norm", "seed": 1.5},
    ],
)
def test_bad_kernel_noise_fields_are_refused(fields: dict[str, Any]) -> None:
    """Each out-of-range or mistyped field raises FaultConfigError at construction."""
    with pytest.raises(FaultConfigError):
        KernelNoise(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"module": ""},
        {"module": "norm", "scale": -1.0},
        {"module": "norm", "scale": float("inf")},
        {"module": "norm", "ranks": ()},
    ],
)
def test_bad_rank_bias_fields_are_refused(fields: dict[str, Any]) -> None:
    """A bias needs a module, a finite scale above -1 and at least one non-negative rank."""
    with pytest.raises(FaultConfigError):
        RankBias(**fields)


def test_an_unknown_module_is_refused_at_install_on_every_rank() -> None:
    """The module name is checked even on a rank the model does not act on."""
    with pytest.raises(FaultConfigError, match="nope"):
        KernelNoise(module="nope", ranks=(1,)).install(_Net(), rank=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["gaussian", "additive", "ulp", "heavy"])
def test_noise_works_on_cuda_outputs(shape: Any) -> None:
    """Noise drawn on the CPU generator is moved to the output's device."""
    net = _Net()
    KernelNoise(module="norm", rel=1e-3, seed=1, shape=shape, fraction=0.1).install(net)
    x = _x(1000).cuda()
    out = net(x)
    assert out.device == x.device and not torch.equal(out, x)
