"""Tolerant mode's replay-to-replay noise per precision, and the signal of a small gradient fault.

The guard's tolerant defaults (sketch block, floor, ceiling per precision) are chosen from these
tables (issue 25). Method of docs/results/soak-bf16.md, in one process on the campaign model
(``campaign_model()``: Llama-style decoder, d_model 32, 2 blocks): a probe of one sample; its
gradients by ``torch.autograd.grad`` of the job's loss, twice, the global RNG seeded the same
for both replays of a pair (as the guard seeds per step and rank); every gradient set
fingerprinted with ``fingerprint.sketches(grads, seed=..., k=4, block=B)`` and the pair compared
as the guard does (``max(worst tensor's sketch_distance, loss relative difference)``). Between
probes each precision's model takes an AdamW step on a random batch, so the weights move as in
training.

Noise: simulated kernels on the final norm, ``KernelNoise(module="norm")`` of each shape on both
replays (the same device, independent draws), and cross-rank pairs: one side Gaussian noise of
rank 0, the other Gaussian noise of rank 1 plus ``RankBias(scale=2e-6)`` (another kernel choice on
the other node). CPU kernels run on one thread are deterministic, so the simulated noise is the
only difference between two replays.

Signal: a backward-only fault, ×f on 8 consecutive values (random position) of
``blocks.0.ffn.down.weight``'s gradient, on the second replay of the Gaussian pair; the fraction
of probes whose distance exceeds the floor (2.5 × the largest noise measured for that precision
and block), and the median distance.

    python benchmarks/noise_tables.py [--pairs 2000] [--out docs/results] [--seed 0] [--tiny]

Writes ``noise-tables.json`` and ``noise-tables.md`` into ``--out``. ``--tiny``: a few pairs, two
precisions (a test that the script runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from replicheck import fingerprint as fp
from replicheck.campaign.scenarios import campaign_model
from replicheck.faults.noise import KernelNoise, NoiseModel, RankBias, install_noise
from replicheck.guard.step.replay import probe_seed
from replicheck.harness.workloads import (
    DecoderConfig,
    lm_loss,
    lm_loss_bf16,
    lm_loss_fp16,
    make_model,
    synthetic_batch,
)

FORMAT = "replicheck.noise_tables/1"
PRECISIONS = ("fp32", "fp16_autocast", "bf16_autocast", "bf16_params")
TINY_PRECISIONS = ("fp32", "bf16_autocast")
BLOCKS = (4096, 256)
NOISES = ("gaussian", "additive", "ulp", "heavy", "cross_rank")
FACTORS = (1.01, 1.1, 1.5, 2.0, 3.0)
FAULT_TENSOR = "blocks.0.ffn.down.weight"
FAULT_VALUES = 8
SKETCH_K = 4
SAFETY = 2.5
"""Floor = SAFETY × the largest noise measured (over every shape, cross-rank included)."""
CEILING_RATIO = 2.5
"""Ceiling = CEILING_RATIO × the floor."""
LR = 1e-3
TRAIN_BATCH = 4
PROBE_RANK = 1_000
"""The ``rank`` argument of the probes' synthetic batches: samples the training never sees."""

DESCRIPTIONS = {
    "fp32": "fp32 parameters and compute (`lm`)",
    "fp16_autocast": "fp16 autocast forward, fp32 parameters (`lm_fp16`), trained with a `GradScaler` whose current scale multiplies the probe's loss, as the guard's probes do",
    "bf16_autocast": "bf16 autocast forward, fp32 parameters (`lm_bf16`)",
    "bf16_params": "bf16 parameters (`model.to(torch.bfloat16)`), no autocast; loss on fp32 logits",
}


def noise_models(name: str, seed: int) -> dict[str, list[NoiseModel]]:
    """Per replica kind, the noise models it carries: one kind per same-device shape, and
    ``rank1_bias`` for the other side of a cross-rank pair (its first side is ``gaussian``)."""
    s = seed * 100
    return {
        "gaussian": [KernelNoise(module=name, rel=1e-6, seed=s + 1)],
        "additive": [KernelNoise(module=name, rel=1e-6, seed=s + 2, shape="additive")],
        "ulp": [KernelNoise(module=name, seed=s + 3, shape="ulp", fraction=1e-3)],
        "heavy": [KernelNoise(module=name, rel=1e-6, seed=s + 4, shape="heavy")],
        "rank1_bias": [
            KernelNoise(module=name, rel=1e-6, seed=s + 1),
            RankBias(module=name, scale=2e-6, ranks=(1,)),
        ],
    }


REPLICA_RANK = {"rank1_bias": 1}
"""The rank a replica kind is installed as (0 unless named): its generator's and bias's rank."""
PAIRS: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    n: ((n, 0), (n, 1)) for n in NOISES if n != "cross_rank"
} | {"cross_rank": (("gaussian", 0), ("rank1_bias", 0))}
"""Per noise row, the two sides of a pair: (replica kind, its replay's number). The first side of
``cross_rank`` is the Gaussian pair's first replay (another independent draw of the same noise)."""
REPLAYS = {"gaussian": 2, "additive": 2, "ulp": 2, "heavy": 2, "rank1_bias": 1}
"""Replays per probe of each replica kind."""


def bf16_params_loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of a bf16 model, on its logits cast to fp32."""
    logits = module(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())


LOSSES: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]] = {
    "fp32": lm_loss,
    "fp16_autocast": lm_loss_fp16,
    "bf16_autocast": lm_loss_bf16,
    "bf16_params": bf16_params_loss,
}


@dataclasses.dataclass
class Precision:
    """One precision's trained model, its noisy replicas and what was measured on it."""

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    replicas: dict[str, torch.nn.Module]
    noise: dict[tuple[int, str], list[tuple[float, float]]]
    """(block, noise) -> per pair (worst tensor distance, loss relative difference)."""
    signal: dict[tuple[int, float], list[float]]
    """(block, factor) -> per pair the faulty pair's distance."""
    losses: list[float]
    scaler: torch.amp.GradScaler | None = None
    """fp16: the training's loss scaler (the probes are scaled by its current scale)."""
    nonfinite: int = 0
    """Probes a replay of which had non-finite gradients or loss (a loss-scale overflow, which
    the guard tells apart from corruption and the scaler skips): not measured."""


def _build(name: str, cfg: DecoderConfig, seed: int) -> Precision:
    model = make_model(cfg, seed=seed)
    if name == "bf16_params":
        model = model.to(torch.bfloat16)
    replicas: dict[str, torch.nn.Module] = {}
    for kind, models in noise_models("norm", seed).items():
        replica = make_model(cfg, seed=seed).to(next(model.parameters()).dtype)
        install_noise(models, replica, rank=REPLICA_RANK.get(kind, 0))
        replicas[kind] = replica
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu") if name == "fp16_autocast" else None
    return Precision(name, model, opt, replicas, {}, {}, [], scaler)


def _sync(p: Precision) -> None:
    """Every replica takes the trained model's current weights."""
    src = list(p.model.parameters())
    with torch.no_grad():
        for replica in p.replicas.values():
            torch._foreach_copy_(list(replica.parameters()), src)


def _train_step(p: Precision, cfg: DecoderConfig, step: int, seed: int) -> None:
    batch = synthetic_batch(cfg, step=step, rank=0, batch=TRAIN_BATCH, seed=seed)
    p.opt.zero_grad(set_to_none=True)
    loss = LOSSES[p.name](p.model, batch)
    if p.scaler is None:
        loss.backward()  # type: ignore[no-untyped-call]
        p.opt.step()
    else:
        p.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        p.scaler.step(p.opt)
        p.scaler.update()
    p.losses.append(float(loss.detach()))


def _replay(
    p: Precision, replica: torch.nn.Module, sample: dict[str, torch.Tensor], seed: int
) -> tuple[float, list[torch.Tensor]]:
    """One probe pass as the guard runs it: the global RNG seeded, gradients by autograd.grad."""
    weight = 1.0 if p.scaler is None else p.scaler.get_scale()
    torch.manual_seed(seed)
    loss = LOSSES[p.name](replica, sample)
    grads = torch.autograd.grad(loss * weight, list(replica.parameters()))
    return float(loss.detach()), [g.detach() for g in grads]


def _loss_distance(a: float, b: float) -> float:
    """The loss part of the guard's tolerant distance (guard/attribution/compare.py)."""
    if a == b:
        return 0.0
    if a != a or b != b:
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _alone(rows: torch.Tensor) -> torch.Tensor:
    """One tensor's sketch rows renumbered as tensor 0 (sketch_distance of that tensor alone)."""
    rows = rows.clone()
    rows[:, 0] = 0
    return rows


def _probe(
    p: Precision, cfg: DecoderConfig, i: int, seed: int, gen: torch.Generator, fault_index: int, check: bool
) -> None:
    sample = synthetic_batch(cfg, step=i, rank=PROBE_RANK, batch=1, seed=seed)
    pseed = probe_seed(seed, i, 0)
    runs = {
        kind: [_replay(p, p.replicas[kind], sample, pseed) for _ in range(n)] for kind, n in REPLAYS.items()
    }
    if not all(
        math.isfinite(loss) and all(bool(g.isfinite().all()) for g in gs)
        for r in runs.values()
        for loss, gs in r
    ):
        p.nonfinite += 1
        return
    numel = runs["gaussian"][1][1][fault_index].numel()
    pos = int(torch.randint(0, numel - FAULT_VALUES + 1, (1,), generator=gen))
    for block in BLOCKS:
        prints = {
            kind: [fp.sketches(g, seed=pseed, k=SKETCH_K, block=block) for _, g in replays]
            for kind, replays in runs.items()
        }
        for noise in NOISES:
            (ka, ia), (kb, ib) = PAIRS[noise]
            (la, _), (lb, _) = runs[ka][ia], runs[kb][ib]
            per_tensor = fp.sketch_distance(prints[ka][ia], prints[kb][ib])
            p.noise.setdefault((block, noise), []).append((float(per_tensor.max()), _loss_distance(la, lb)))
            if noise != "gaussian":
                continue
            # The fault touches one weight gradient only (nothing downstream of it in the pass):
            # the faulty pair differs from the clean one in that tensor's sketch alone.
            others = torch.cat([per_tensor[:fault_index], per_tensor[fault_index + 1 :]])
            base = max(float(others.max()), _loss_distance(la, lb))
            clean_b = runs["gaussian"][1][1]
            rows_a = fp.sketch_rows(
                runs["gaussian"][0][1][fault_index], index=fault_index, seed=pseed, k=SKETCH_K, block=block
            )
            for f in FACTORS:
                faulty = clean_b[fault_index].clone()
                faulty.view(-1)[pos : pos + FAULT_VALUES] *= f
                rows_b = fp.sketch_rows(faulty, index=fault_index, seed=pseed, k=SKETCH_K, block=block)
                d = max(base, float(fp.sketch_distance(_alone(rows_a), _alone(rows_b))[0]))
                if check:  # the shortcut gives what the whole fingerprint gives
                    whole = list(clean_b)
                    whole[fault_index] = faulty
                    full = fp.sketch_distance(
                        prints["gaussian"][0], fp.sketches(whole, seed=pseed, k=SKETCH_K, block=block)
                    )
                    assert max(float(full.max()), _loss_distance(la, lb)) == d, (block, f)
                p.signal.setdefault((block, f), []).append(d)


def _quantiles(xs: Sequence[float]) -> dict[str, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
    return {"q50": q[0], "q99": q[1], "q99_9": q[2], "max": float(t.max())}


def nice_up(x: float) -> float:
    """``x`` rounded up to two significant digits (a floor worth writing down)."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    m = math.ceil(round(x / 10**e, 9))
    while float(f"{m}e{e}") < x:  # the rounding above must never take it below x
        m += 1
    return float(f"{m}e{e}")  # via text: 6e-05, not 5.9999999999999995e-05


def summarize(precisions: Sequence[Precision]) -> dict[str, Any]:
    """The noise rows, the floors they give, the signal rows at those floors, and per precision
    the recommended block, floor and ceiling."""
    noise_rows: list[dict[str, Any]] = []
    floors: dict[tuple[str, int], float] = {}
    for p in precisions:
        for block in BLOCKS:
            worst = 0.0
            for noise in NOISES:
                pairs = p.noise[(block, noise)]
                dist = [max(t, loss) for t, loss in pairs]
                worst = max(worst, max(dist))
                noise_rows.append(
                    dict(
                        precision=p.name,
                        block=block,
                        noise=noise,
                        pairs=len(dist),
                        nonfinite=p.nonfinite,
                        zero_fraction=sum(d == 0 for d in dist) / len(dist),
                        **_quantiles(dist),
                        loss_max=max(loss for _, loss in pairs),
                    )
                )
            floors[(p.name, block)] = nice_up(SAFETY * max(worst, 1e-9))
    signal_rows: list[dict[str, Any]] = []
    for p in precisions:
        for block in BLOCKS:
            floor = floors[(p.name, block)]
            for f in FACTORS:
                d = p.signal[(block, f)]
                t = torch.tensor(d, dtype=torch.float64)
                signal_rows.append(
                    dict(
                        precision=p.name,
                        block=block,
                        factor=f,
                        pairs=len(d),
                        floor=floor,
                        detected=float((t > floor).double().mean()),
                        median=float(t.median()),
                        q10=float(torch.quantile(t, 0.1)),
                    )
                )
    recommendation: dict[str, Any] = {}
    for p in precisions:
        options = []
        for block in BLOCKS:
            floor = floors[(p.name, block)]
            caught = [r["detected"] for r in signal_rows if r["precision"] == p.name and r["block"] == block]
            worst = max(r["max"] for r in noise_rows if r["precision"] == p.name and r["block"] == block)
            options.append((sum(caught) / len(caught), block, floor, worst))
        # The block that catches more of the faults at its own floor; on a tie the larger block
        # (a smaller fingerprint: (k + 3) float64 values per block).
        caught, block, floor, worst = max(options, key=lambda o: (round(o[0], 3), o[1]))
        recommendation[p.name] = dict(
            block=block,
            floor=floor,
            ceiling=nice_up(max(CEILING_RATIO * floor, worst)),
            max_noise=worst,
            mean_detected=caught,
        )
    return dict(noise=noise_rows, signal=signal_rows, recommendation=recommendation)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf"
    return f"{x:.2g}" if x < 1e-3 or x >= 100 else f"{x:.3g}"


def markdown(result: dict[str, Any]) -> str:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    lines = [
        "# Tolerant-mode noise tables per precision",
        "",
        "Made with:",
        "",
        "```",
        f"python benchmarks/noise_tables.py --pairs {cfg['pairs']} --seed {cfg['seed']}"
        + (" --tiny" if result["mode"] == "tiny" else ""),
        "```",
        "",
        f"{cfg['pairs']:,} probes per precision, {result['seconds'] / 60:.1f} min wall time in one process "
        f"(torch {m['torch']}, {m['cores']} CPU cores, {m['threads']} torch thread, {m['platform']}).",
        "",
        "## Method",
        "",
        "The campaign model (Llama-style decoder, d_model 32, 2 blocks, 16 tokens, "
        f"{cfg['parameters']:,} parameters in {cfg['tensors']} tensors); a probe of one sample; its gradients by "
        "`torch.autograd.grad` of the job's loss, twice (a pair), with the global RNG seeded the same "
        "for both replays as the guard seeds per step and rank; each gradient set fingerprinted with "
        f"`fingerprint.sketches(grads, seed=..., k={SKETCH_K}, block=B)`; the pair's distance is the guard's "
        "tolerant distance, max(worst tensor's `sketch_distance`, loss relative difference). Between "
        f"probes each precision's model takes one AdamW step (lr {LR:g}) on a random batch of "
        f"{TRAIN_BATCH}, so the weights move as in training (training loss "
        + ", ".join(f"{n} {cfg['loss_first'][n]:.2f} → {cfg['loss_last'][n]:.2f}" for n in cfg["precisions"])
        + ").",
        "",
        "Precisions:",
        "",
        *[f"* `{name}`: {DESCRIPTIONS[name]}" for name in cfg["precisions"]],
        "",
        'Noise (simulated kernels on the final norm\'s output, `module="norm"`; `replicheck.faults.noise`):',
        "",
        "* `gaussian`: `KernelNoise(rel=1e-6)` on both replays (same device, independent draws);",
        '* `additive`: `KernelNoise(rel=1e-6, shape="additive")`, the same way;',
        '* `ulp`: `KernelNoise(shape="ulp", fraction=1e-3)`, the same way;',
        '* `heavy`: `KernelNoise(rel=1e-6, shape="heavy")` (Student-t, df 2, clipped at 100);',
        "* `cross_rank`: one replay with rank 0's Gaussian noise, the other with rank 1's Gaussian "
        "noise and `RankBias(scale=2e-6)` (the two sides of a pair are ranks with different kernel "
        "choices).",
        "",
        "On the CPU with one thread the kernels themselves are deterministic: without a noise model "
        "both replays agree bit for bit, so these figures are the simulated noise as it propagates "
        "through the model and the sketch. A GPU's own kernels are not measured here "
        "(`benchmarks/gpu_check.py` records a tolerant bf16 run's largest pair distance on one).",
        "",
        "## Noise: distance between two clean replays",
        "",
        "Per precision, sketch block and noise: pairs, the fraction of pairs exactly equal, "
        "quantiles of the distance, and the largest loss relative difference.",
        "",
        "| precision | block | noise | pairs | zero | q50 | q99 | q99.9 | max | loss max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["noise"]:
        lines.append(
            f"| {r['precision']} | {r['block']} | {r['noise']} | {r['pairs']:,} | {r['zero_fraction']:.2f} "
            f"| {_fmt(r['q50'])} | {_fmt(r['q99'])} | {_fmt(r['q99_9'])} | {_fmt(r['max'])} | {_fmt(r['loss_max'])} |"
        )
    skipped = {r["precision"]: r["nonfinite"] for r in s["noise"]}
    lines += [
        "",
        "Probes not measured because a replay had non-finite gradients (a loss-scale overflow, which "
        "the guard tells apart from corruption and the scaler skips): "
        + ", ".join(f"{name} {n}" for name, n in skipped.items())
        + (
            f" (the fp16 scaler's scale at the end: {cfg['fp16_scale_last']:g})."
            if cfg.get("fp16_scale_last")
            else "."
        ),
    ]
    lines += [
        "",
        "## Signal: a backward-only fault against a clean replay",
        "",
        f"×f on {FAULT_VALUES} consecutive values (random position) of `{FAULT_TENSOR}`'s gradient "
        f"({cfg['fault_numel']:,} values) in the second replay of the `gaussian` pair. Floor: "
        f"{SAFETY:g} × the largest noise of the precision and block over every noise row above "
        "(rounded up to two digits); caught: the fraction of probes whose distance exceeds it.",
        "",
        "| precision | block | floor | " + " | ".join(f"×{f:g} caught (median)" for f in FACTORS) + " |",
        "|---|---|---|" + "---|" * len(FACTORS),
    ]
    for p in cfg["precisions"]:
        for block in BLOCKS:
            rows = [r for r in s["signal"] if r["precision"] == p and r["block"] == block]
            cells = " | ".join(f"{r['detected']:.2f} ({_fmt(r['median'])})" for r in rows)
            lines.append(f"| {p} | {block} | {_fmt(rows[0]['floor'])} | {cells} |")
    largest = max(t.numel() for t in make_model(DecoderConfig(**cfg["model"])).parameters())
    silent = [
        f"{r['precision']}/{r['noise']}"
        for r in s["noise"]
        if r["zero_fraction"] == 1 and r["block"] == BLOCKS[0]
    ]
    lines += [
        "",
        "## Reading the tables",
        "",
        f"* The largest tensor of this model has {largest:,} values, so a block of {max(BLOCKS):,} "
        + ("is the whole-tensor sketch here" if largest <= max(BLOCKS) else "splits only the largest tensors")
        + "; in a model with larger tensors such a block is a slice of a tensor, as the smaller blocks "
        "are here, and these figures do not carry over.",
        "* Under autocast the final norm's output is fp32 (the residual stream stays fp32): a noise "
        "model shows only when it changes how the head's input rounds to fp16/bf16, and then by whole "
        "half-precision ulps (many pairs exactly zero, a long tail). With bf16 parameters the "
        "output itself is bf16, whose ulp (2^-8 relative) swallows a 1e-6 relative change: the `ulp` "
        "shape moves it, the additive shapes only on values near zero, the relative ones never.",
        "* Rows with every pair exactly zero: " + (", ".join(f"`{x}`" for x in silent) or "none") + ".",
        "* The floor must also cover the cross-rank rows: the guard's calibration replays a rank's own "
        "probe on the same rank, so it never sees a constant per-rank difference.",
    ]
    lines += [
        "",
        "## Recommended tolerant defaults",
        "",
        f"Floor: {SAFETY:g} × the largest noise measured for the precision and block (every noise row, "
        f"cross-rank included), rounded up; ceiling: {CEILING_RATIO:g} × the floor, never below the "
        "largest noise; block: the one catching more of the faults above at its own floor (on a tie "
        "the larger, whose fingerprint is smaller).",
        "",
        "| precision | sketch block | floor | ceiling | largest noise | mean fraction caught |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in s["recommendation"].items():
        lines.append(
            f"| {name} | {r['block']} | {_fmt(r['floor'])} | {_fmt(r['ceiling'])} | {_fmt(r['max_noise'])} "
            f"| {r['mean_detected']:.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def run(
    pairs: int, seed: int, precisions: Sequence[str], check: bool, progress: bool, raw: str | None = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = campaign_model()
    t0 = time.perf_counter()
    states = [_build(name, cfg, seed) for name in precisions]
    names = [n for n, _ in states[0].model.named_parameters()]
    fault_index = names.index(FAULT_TENSOR)
    gen = torch.Generator().manual_seed(seed * 7 + 3)
    for i in range(pairs):
        for p in states:
            _train_step(p, cfg, i, seed)
            _sync(p)
            _probe(p, cfg, i, seed, gen, fault_index, check)
        if progress and (i + 1) % max(1, pairs // 20) == 0:
            print(f"{i + 1}/{pairs} probes, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if raw is not None:  # every pair's distances, for another look without another run
        torch.save(
            {
                "noise": {
                    f"{p.name}/{b}/{n}": torch.tensor(v) for p in states for (b, n), v in p.noise.items()
                },
                "signal": {
                    f"{p.name}/{b}/{f}": torch.tensor(v) for p in states for (b, f), v in p.signal.items()
                },
            },
            raw,
        )
    params = list(states[0].model.parameters())
    config = dict(
        pairs=pairs,
        seed=seed,
        precisions=list(precisions),
        blocks=list(BLOCKS),
        noises=list(NOISES),
        noise_models={
            kind: [dict(type=type(m).__name__, **dataclasses.asdict(m)) for m in models]
            for kind, models in noise_models("norm", seed).items()
        },
        pairs_of={n: [list(side) for side in PAIRS[n]] for n in NOISES},
        model=dataclasses.asdict(cfg),
        parameters=sum(p.numel() for p in params),
        tensors=len(params),
        sketch_k=SKETCH_K,
        factors=list(FACTORS),
        fault_tensor=FAULT_TENSOR,
        fault_values=FAULT_VALUES,
        fault_numel=params[fault_index].numel(),
        safety=SAFETY,
        ceiling_ratio=CEILING_RATIO,
        fp16_scale_last=next((p.scaler.get_scale() for p in states if p.scaler is not None), None),
        lr=LR,
        train_batch=TRAIN_BATCH,
        loss_first={p.name: p.losses[0] for p in states},
        loss_last={p.name: p.losses[-1] for p in states},
    )
    machine = dict(
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(terse=True),
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
    )
    return dict(
        format=FORMAT,
        config=config,
        machine=machine,
        seconds=round(seconds, 1),
        summary=summarize(states),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--pairs", type=int, default=2000, help="probes (pairs per row) per precision")
    ap.add_argument("--out", default="docs/results", help="directory for noise-tables.json and .md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a few pairs, two precisions (a test)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--raw", help="also save every pair's distances here (torch.save)")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    pairs = min(args.pairs, 4) if args.tiny else args.pairs
    precisions = TINY_PRECISIONS if args.tiny else PRECISIONS
    result = run(pairs, args.seed, precisions, check=args.tiny, progress=not args.no_progress, raw=args.raw)
    result["mode"] = "tiny" if args.tiny else "full"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise-tables.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "noise-tables.md").write_text(markdown(result))
    for name, r in result["summary"]["recommendation"].items():
        print(
            f"{name}: block {r['block']}, floor {r['floor']:g}, ceiling {r['ceiling']:g} (largest noise {r['max_noise']:.3g})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
