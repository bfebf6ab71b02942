"""The soak: clean training, verified on every step, counting checks and false alarms.

A verification *pair* is one rank's probe replayed by its verifier, so a verification step of
a ``world``-rank job adds ``world`` pairs. Progress comes back through a small file the first
rank rewrites every few hundred steps (the job itself runs in child processes).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from replicheck.campaign.scenarios import bf16_tolerant, campaign_model, soak_model, tolerance_overrides
from replicheck.faults.noise import KernelNoise
from replicheck.guard import GuardConfig, current_pass, current_step
from replicheck.guard.config import Mode
from replicheck.guard.modules import unwrap
from replicheck.harness.jobs import JobLoss, JobSpec, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig


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
    timeout: float = 4 * 3600.0
    """Seconds before the job is killed."""
    loss: JobLoss = "lm"
    """The job's loss (``lm_bf16``: forward under bf16 autocast)."""
    noise: KernelNoise | None = None
    """Simulated kernel noise on every rank."""
    tolerance_floor: float | None = None
    """Override of the guard's tolerant floor."""
    tolerance_ceiling: float | None = None
    """Override of the guard's tolerant ceiling."""
    sketch_block: int | None = None
    """Override of the guard's sketch block (values per block)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def steps(self) -> int:
        return math.ceil(self.pairs / self.world)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bf16_soak(cfg: SoakConfig, *, tiny: bool = False) -> SoakConfig:
    """``cfg`` made the bf16 soak: tolerant mode, bf16 autocast, kernel noise on the final norm
    of every rank, the campaign model (``tiny``: the soak model) and the bf16 tolerance."""
    return replace(
        cfg,
        **bf16_tolerant(),
        model=soak_model() if tiny else campaign_model(),
        batch=4 if not tiny else cfg.batch,
    )


def _progress_hook(
    ctx: RankContext,
    model: torch.nn.Module,
    opt: Any,
    guard: Any,
    *,
    path: str,
    every: int,
    noise: KernelNoise | None = None,
) -> None:
    if noise is not None:
        noise.install(model, rank=ctx.rank)
    if ctx.rank != 0:
        return
    bare = unwrap(model)

    def pre(_m: torch.nn.Module, _inp: Any) -> None:
        s = current_step()
        if current_pass() == "train" and s % every == 0:
            Path(path).write_text(str(s))

    bare.register_forward_pre_hook(pre)


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
        setup=functools.partial(_progress_hook, path=path, every=every, noise=cfg.noise),
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
            train, node_names(cfg.nodes, cfg.gpus_per_node), args=(spec,), timeout=cfg.timeout
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
        config={**asdict(cfg), "model": asdict(cfg.model or soak_model())},
    )


def soak_markdown(result: SoakResult, command: str, cpus: int, torch_version: str) -> str:
    """``soak.md``: the figures, how they were made, and the reference."""
    r = result
    model = r.config["model"]
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
                f"Clean training of a tiny Llama-style decoder (d_model {model['d_model']}, {model['n_layers']} block, "
                f"{model['seq_len']} tokens, batch {r.config['batch']} per rank) on {r.config['nodes']} simulated nodes × "
                f"{r.config['gpus_per_node']} ranks (gloo, {cpus} CPU cores, torch {torch_version}), "
                f"{r.config['mode']} mode, ring replay on every step, weights and optimizer state compared every "
                f"{r.config['weights_every']} step(s).",
                "",
            ]
            + (
                [
                    f"Loss `{r.config['loss']}` (forward under bf16 autocast), simulated kernel noise "
                    f"{r.config['noise']['rel']:g} relative on `{r.config['noise']['module']}` on every rank and pass, "
                    f"tolerance floor {r.config['tolerance_floor']:g}, ceiling {r.config['tolerance_ceiling']:g}, "
                    f"sketch block {r.config.get('sketch_block') or 'default'}.",
                    "",
                ]
                if r.config.get("loss") == "lm_bf16" and r.config.get("noise")
                else []
            )
            + [
                "| figure | replicheck | published reference (AWS) |",
                "|---|---|---|",
                f"| verification pairs | {r.verification_pairs:,} ({r.verification_steps:,} steps × {r.world} ranks) | 15,320 |",
                f"| weight checks | {r.weight_checks:,} | 3,080 |",
                f"| false alarms | {r.false_alarms} | 0 |",
                f"| wall time | {r.seconds / 60:.1f} min ({r.ms_per_step:.1f} ms per step) | – |",
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
