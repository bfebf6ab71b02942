"""Rank functions for the tolerant-defaults tests: several guarded runs in one launch (each run
builds its own model, optimizer and guard over the launch's process group)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from replicheck.faults.noise import NoiseModel, install_noise
from replicheck.guard import Guard
from replicheck.harness.jobs import JobLoss, JobSpec, train
from replicheck.harness.launch import RankContext


@dataclass(frozen=True)
class Run:
    """One clean guarded run of a launch."""

    loss: JobLoss
    noise: tuple[NoiseModel, ...]
    seed: int
    spec: JobSpec


@dataclass(frozen=True)
class Outcome:
    """What a rank saw of one run."""

    loss: JobLoss
    seed: int
    noise: tuple[str, ...]
    last_step: int
    incident: dict[str, Any] | None
    tolerance: dict[str, Any] | None
    threshold: float | None


def _install(
    ctx: RankContext, model: Any, opt: Any, guard: Guard, *, noise: tuple[NoiseModel, ...], seen: list[Guard]
) -> None:
    install_noise(noise, model, ctx.rank)
    seen.append(guard)


def runs(ctx: RankContext, plan: list[Run]) -> list[Outcome]:
    """Every run of ``plan`` in turn on this rank; what each ended with."""
    out = []
    for run in plan:
        seen: list[Guard] = []
        spec = JobSpec(
            **{**run.spec.__dict__, "setup": functools.partial(_install, noise=run.noise, seen=seen)}
        )
        result = train(ctx, spec)
        guard = seen[0]
        tol = guard.tolerance
        out.append(
            Outcome(
                loss=run.loss,
                seed=run.seed,
                noise=tuple(type(n).__name__ for n in run.noise),
                last_step=result.last_step,
                incident=result.incident,
                tolerance=None if tol is None else tol.to_evidence(),
                threshold=guard.threshold,
            )
        )
    return out


def mixed_precisions(ctx: RankContext, spec: JobSpec) -> str:
    """Rank 1 trains in fp32 while the others use bf16 autocast; returns what the step raised."""
    loss: JobLoss = "lm" if ctx.rank == 1 else "lm_bf16"
    try:
        result = train(ctx, JobSpec(**{**spec.__dict__, "loss": loss}))
    except Exception as exc:  # noqa: BLE001 - the test reads which error every rank saw
        return f"{type(exc).__name__}: {exc}"
    return f"no error; incident {result.incident and result.incident['check']}"
