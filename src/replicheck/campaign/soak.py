"""The soak: clean training, verified on every step, counting checks and false alarms.

A verification *pair* is one rank's probe replayed by its verifier, so a verification step of
a ``world``-rank job adds ``world`` pairs. Progress comes back through a small file the first
rank rewrites every few hundred steps (the job itself runs in child processes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from replicheck.campaign.scenarios import bf16_tolerant, campaign_model, soak_model, tolerance_overrides
from replicheck.faults.errors import FaultConfigError
from replicheck.faults.noise import KernelNoise, NoiseModel, NoiseShape, RankBias, install_noise
from replicheck.guard import Guard, GuardConfig, current_pass, current_step
from replicheck.guard.config import Mode
from replicheck.guard.modules import unwrap
from replicheck.harness.jobs import JobLoss, JobSpec, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig

NOISE_SHAPES: tuple[str, ...] = ("gaussian", "additive", "ulp", "heavy", "bias")
"""What ``--noise`` takes: the four :class:`KernelNoise` shapes, and ``bias`` (a
:class:`RankBias` on rank 1: another kernel choice on one node)."""
NOISE_MODULE = "norm"
"""The module the soak's noise models perturb: the decoder's final norm."""
SECONDS_PER_PAIR = 0.15
"""The soak's time budget per verification pair: 2.5 times the ~60 ms a pair measured on 2
shared CPU cores (docs/results/soak-bf16.md)."""
MIN_TIMEOUT = 4 * 3600.0
"""The shortest default time limit of a soak (100,000 pairs take about 1.7 h at 60 ms a pair)."""


def parse_noise(text: str) -> tuple[str, ...]:
    """``--noise``'s value: a comma list of :data:`NOISE_SHAPES`, or ``none``; in the order given,
    without repeats. Raises :class:`FaultConfigError` naming an unknown shape."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in NOISE_SHAPES]
    if unknown or not names:
        what = (
            f"unknown noise shape(s) {', '.join(map(repr, unknown))}" if unknown else "no noise shape given"
        )
        raise FaultConfigError(f"{what}; use a comma list of {', '.join(NOISE_SHAPES)}, or none")
    return tuple(dict.fromkeys(names))


def soak_noise(shapes: Sequence[str] = NOISE_SHAPES) -> tuple[NoiseModel, ...]:
    """The noise models of ``shapes`` on the final norm: each :class:`KernelNoise` shape on every
    rank at its defaults (1e-6) with its own seed, ``bias`` a :class:`RankBias` on rank 1."""
    models: list[NoiseModel] = []
    for shape in parse_noise(",".join(shapes) or "none"):
        if shape == "bias":
            models.append(RankBias(module=NOISE_MODULE))
        else:
            # A fixed seed per shape (gaussian keeps the campaign's 1): the soak is reproducible,
            # and no two shapes draw the same sequence from their generators.
            seed = NOISE_SHAPES.index(shape) + 1
            models.append(KernelNoise(module=NOISE_MODULE, shape=cast(NoiseShape, shape), seed=seed))
    return tuple(models)


def describe_noise(model: Mapping[str, Any]) -> str:
    """One noise model (as the soak's JSON holds it) in words."""
    where = f"`{model.get('module')}`"
    if model.get("kind") == "RankBias":
        ranks = ", ".join(map(str, model.get("ranks") or ()))
        return f"constant bias ×(1 + {model.get('scale'):g}) on {where}, rank(s) {ranks} (`RankBias`)"
    shape = str(model.get("shape", "gaussian"))
    size = {
        "gaussian": f"{model.get('rel'):g} relative",
        "additive": f"{model.get('rel'):g} × mean |output|",
        "ulp": f"one ulp on a fraction {model.get('fraction', 1e-3):g} of the values",
        "heavy": (
            f"{model.get('rel'):g} × mean |output| × Student-t (df {model.get('df', 2.0):g}, "
            f"clipped at {model.get('clip', 100.0):g})"
        ),
    }.get(shape, str(shape))
    only = model.get("ranks")
    on = "every rank" if only is None else "rank(s) " + ", ".join(map(str, only))
    return f"{shape}: {size} on {where}, {on} (`KernelNoise`)"


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """A soak run."""

    pairs: int = 100_000
    """Verification pairs to reach (steps = pairs / world size, rounded up)."""
    nodes: int = 2
    """Simulated nodes."""
    gpus_per_node: int = 2
    """Ranks per node."""
    mode: Mode = "exact"
    """Guard mode."""
    weights_every: int = 1
    """Weight/optimizer-state comparison period."""
    batch: int = 2
    """Sequences per rank per step."""
    model: DecoderConfig | None = None
    """Decoder shape (``None``: :func:`soak_model`)."""
    seed: int = 0
    """Seed of weights and data."""
    timeout: float | None = None
    """Seconds before the job is killed (``None``: :data:`SECONDS_PER_PAIR` per pair, at least
    :data:`MIN_TIMEOUT`)."""
    loss: JobLoss = "lm"
    """The job's loss (``lm_bf16``: forward under bf16 autocast)."""
    noise: tuple[NoiseModel, ...] = ()
    """Simulated kernel noise and per-rank kernel choices, installed with
    :func:`~replicheck.faults.noise.install_noise` on every rank (each on the ranks it names)."""
    tolerance_floor: float | None = None
    """Override of the guard's tolerant floor (``None``: the guard chooses it by precision)."""
    tolerance_ceiling: float | None = None
    """Override of the guard's tolerant ceiling (``None``: chosen by precision)."""
    sketch_block: int | None = None
    """Override of the guard's sketch block, values per block (``None``: chosen by precision)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def steps(self) -> int:
        return math.ceil(self.pairs / self.world)

    @property
    def time_limit(self) -> float:
        """Seconds the job may run: :attr:`timeout`, or its default for :attr:`pairs`."""
        if self.timeout is not None:
            return self.timeout
        return max(MIN_TIMEOUT, SECONDS_PER_PAIR * self.pairs)


@dataclass
class SoakResult:
    """The soak's figures."""

    steps: int
    world: int
    verification_steps: int
    verification_pairs: int
    weight_checks: int
    false_alarms: int
    seconds: float
    ms_per_step: float
    final_loss: float | None
    first_loss: float | None
    incident: dict[str, Any] | None
    config: dict[str, Any]
    pairs_per_second: float = 0.0
    """Verification pairs per second of wall time (start-up included)."""
    tolerance: dict[str, Any] | None = None
    """Tolerant mode: what the guard used on rank 0 (precision, sketch_block, floor, ceiling,
    threshold), read from the guard at the run's last step; ``None`` in exact mode."""
    tolerances: list[dict[str, Any] | None] = field(default_factory=list)
    """The same, per rank."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bf16_soak(cfg: SoakConfig, *, tiny: bool = False, noise: Sequence[str] = NOISE_SHAPES) -> SoakConfig:
    """``cfg`` made the bf16 soak: tolerant mode, bf16 autocast, the noise models of ``noise``
    (default: every shape, so one soak covers each), the campaign model (``tiny``: the soak
    model); sketch block, floor and ceiling stay ``cfg``'s (``None``: the guard's bf16 defaults)."""
    return replace(
        cfg,
        **{**bf16_tolerant(), "noise": soak_noise(noise)},
        model=soak_model() if tiny else campaign_model(),
        batch=4 if not tiny else cfg.batch,
    )


def guard_tolerance(guard: Guard) -> dict[str, Any] | None:
    """What tolerant mode uses on this rank, read from the guard: the precision, the sketch block,
    floor and ceiling in force (``chosen``: those the guard took from its table rather than the
    user), the threshold now (the floor raised by calibration) and the smallest change it can
    catch. ``None`` in exact mode and before an ``auto`` job's first forward."""
    tol = guard.tolerance
    if tol is None:
        return None
    return {
        "precision": tol.precision,
        "sketch_block": tol.sketch_block,
        "floor": tol.floor,
        "ceiling": tol.ceiling,
        "threshold": guard.threshold,
        "chosen": list(tol.chosen),
        "smallest_change": tol.smallest_change(),
    }


def _soak_setup(
    ctx: RankContext,
    model: torch.nn.Module,
    opt: Any,
    guard: Guard,
    *,
    path: str,
    every: int,
    noise: Sequence[NoiseModel] = (),
) -> dict[str, Any]:
    """Each rank's setup: the noise models, and a record of the guard's tolerance refreshed
    before every training forward (it is returned with the rank's result, so it holds what the
    guard used at the last step, after calibration). Rank 0 also writes the progress file."""
    install_noise(noise, model, ctx.rank)
    record: dict[str, Any] = {"tolerance": guard_tolerance(guard)}
    bare = unwrap(model)

    def pre(_m: torch.nn.Module, _inp: Any) -> None:
        if current_pass() != "train":
            return
        record["tolerance"] = guard_tolerance(guard)
        s = current_step()
        if ctx.rank == 0 and s % every == 0:
            Path(path).write_text(str(s))

    bare.register_forward_pre_hook(pre)
    return record


def _noise_record(model: NoiseModel) -> dict[str, Any]:
    """One noise model as the soak's JSON holds it: its class name and its fields."""
    return {"kind": type(model).__name__, **dataclasses.asdict(model)}


def run_soak(cfg: SoakConfig, progress: Callable[[int], None] | None = None) -> SoakResult:
    """Run the soak; ``progress(steps_done)`` is called from a watcher thread now and then."""
    fd, path = tempfile.mkstemp(prefix="replicheck-soak-")
    os.close(fd)
    every = max(1, min(200, cfg.steps // 100 or 1))
    tolerance = tolerance_overrides(cfg.tolerance_floor, cfg.tolerance_ceiling, cfg.sketch_block)
    guard = GuardConfig(
        verify_every=1,
        weights_every=cfg.weights_every,
        mode=cfg.mode,
        seed=cfg.seed,
        job_id="soak",
        **tolerance,
    )
    spec = JobSpec(
        steps=cfg.steps,
        batch=cfg.batch,
        model=cfg.model or soak_model(),
        guard=guard,
        seed=cfg.seed,
        setup=functools.partial(_soak_setup, path=path, every=every, noise=cfg.noise),
        loss=cfg.loss,
    )
    stop = threading.Event()

    def watch() -> None:
        last = -1
        while not stop.wait(1.0):
            try:
                done = int(Path(path).read_text() or -1)
            except (OSError, ValueError):
                continue
            if done != last and progress is not None:
                progress(done)
                last = done

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        results = run_local(
            train, node_names(cfg.nodes, cfg.gpus_per_node), args=(spec,), timeout=cfg.time_limit
        )
    finally:
        stop.set()
        watcher.join()
        Path(path).unlink(missing_ok=True)
    seconds = time.monotonic() - started
    r0 = results[0]
    incident = next((r.incident for r in results if r.incident is not None), None)
    done = r0.last_step + 1
    verified = len(r0.verified_steps)
    if progress is not None:
        progress(done)
    tolerances = [(r.setup_result or {}).get("tolerance") for r in results]
    return SoakResult(
        steps=done,
        world=cfg.world,
        verification_steps=verified,
        verification_pairs=verified * cfg.world,
        weight_checks=len([s for s in range(done) if s % cfg.weights_every == 0]) if cfg.weights_every else 0,
        false_alarms=int(incident is not None),
        seconds=round(seconds, 1),
        ms_per_step=round(1000 * seconds / max(done, 1), 2),
        final_loss=r0.losses.get(r0.last_step),
        first_loss=r0.losses.get(0),
        incident=incident,
        config={
            **asdict(cfg),
            "model": asdict(cfg.model or soak_model()),
            "noise": [_noise_record(m) for m in cfg.noise],
            "timeout": cfg.time_limit,
        },
        pairs_per_second=round(verified * cfg.world / max(seconds, 1e-9), 2),
        tolerance=tolerances[0],
        tolerances=tolerances,
    )


def _noise_lines(config: Mapping[str, Any]) -> list[str]:
    noise = config.get("noise") or []
    if isinstance(noise, Mapping):  # a soak written before noise became a list of models
        noise = [{"kind": "KernelNoise", **noise}]
    if not noise:
        return []
    return (
        ["Simulated kernel noise, on every pass (training, probes and replays):", ""]
        + [f"- {describe_noise(m)}" for m in noise]
        + [""]
    )


def _tolerance_lines(r: SoakResult) -> list[str]:
    c = r.config
    if c.get("mode") != "tolerant":
        return []
    set_by_run = {
        k: c.get(k) for k in ("sketch_block", "tolerance_floor", "tolerance_ceiling") if c.get(k) is not None
    }
    chosen = r.tolerance
    if chosen is None:
        text = "Tolerances: not reported by the guard."
    else:

        def fig(key: str) -> str:
            v = chosen.get(key)
            return "–" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

        text = (
            f"Tolerances the guard used (rank 0, read from the guard at the last step): precision "
            f"{fig('precision')}, sketch block {fig('sketch_block')} values, floor {fig('floor')}, "
            f"ceiling {fig('ceiling')}, threshold after calibration {fig('threshold')}."
        )
        if chosen.get("smallest_change"):
            text += f" Smallest change it can catch: {chosen['smallest_change']}."
        differ = [str(rank) for rank, t in enumerate(r.tolerances) if t != chosen]
        if differ:
            text += f" Ranks whose figures differ from rank 0's (see the JSON): {', '.join(differ)}."
    text += (
        " Set by the run: " + ", ".join(f"`{k}={v}`" for k, v in set_by_run.items()) + "."
        if set_by_run
        else " None set by the run: the guard chose them from the job's precision."
    )
    return [text, ""]


def soak_markdown(result: SoakResult, command: str, cpus: int, torch_version: str) -> str:
    """``soak.md``: the figures, how they were made, and the reference."""
    r = result
    model = r.config["model"]
    loss = r.config.get("loss", "lm")
    autocast = {"lm_bf16": " (forward under bf16 autocast)", "lm_fp16": " (forward under fp16 autocast)"}
    rate = r.pairs_per_second or (r.verification_pairs / r.seconds if r.seconds else 0.0)
    return (
        "\n".join(
            [
                "# Soak: false alarms under clean training",
                "",
                "Made with:",
                "",
                "```",
                command,
                "```",
                "",
                f"Clean training of a tiny Llama-style decoder (d_model {model['d_model']}, {model['n_layers']} block{'s' if model['n_layers'] != 1 else ''}, "
                f"{model['seq_len']} tokens, batch {r.config['batch']} per rank) on {r.config['nodes']} simulated nodes × "
                f"{r.config['gpus_per_node']} ranks (gloo, {cpus} CPU cores, torch {torch_version}), "
                f"{r.config['mode']} mode, ring replay on every step, weights and optimizer state compared every "
                f"{r.config['weights_every']} step(s). Loss `{loss}`{autocast.get(loss, '')}.",
                "",
            ]
            + _noise_lines(r.config)
            + _tolerance_lines(r)
            + [
                "| figure | replicheck | published reference (AWS) |",
                "|---|---|---|",
                f"| verification pairs | {r.verification_pairs:,} ({r.verification_steps:,} steps × {r.world} ranks) | 15,320 |",
                f"| weight checks | {r.weight_checks:,} | 3,080 |",
                f"| false alarms | {r.false_alarms} | 0 |",
                f"| wall time | {r.seconds / 60:.1f} min ({r.ms_per_step:.1f} ms per step) | – |",
                f"| verification pairs per second | {rate:.1f} | – |",
                f"| loss first → last step | {r.first_loss:.3f} → {r.final_loss:.3f} | – |"
                if r.first_loss is not None and r.final_loss is not None
                else "| loss | – | – |",
                "",
            ]
            + (
                [f"First alarm: step {r.incident['step']}, check {r.incident['check']}."]
                if r.incident
                else []
            )
        )
        + "\n"
    )
