"""The campaign runner: each scenario as a local multi-process guarded job, then its outcome.

A scenario runs as a gloo job on simulated nodes (:func:`replicheck.harness.launch.run_local`); the
fault is installed by the job's per-rank setup hook, which hands the injector's records back
with the rank's result, so the outcome says what was really corrupted, not what was intended.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from replicheck.campaign import setups
from replicheck.campaign.scenarios import JobDefaults, Scenario, tolerance_overrides
from replicheck.faults.errors import FaultConfigError
from replicheck.faults.injector import Corruption, Fault
from replicheck.faults.noise import NoiseModel, install_noise
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import synthetic_batch

_MAX_RECORDS = 50


def install_for_campaign(
    ctx: RankContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    guard: Any,
    *,
    fault: Fault | None,
    noise: Sequence[NoiseModel] = (),
    poison: tuple[int, torch.Tensor] | None = None,
) -> list[Corruption]:
    """The job's setup hook: simulated kernel noise (each model installed on the ranks it names)
    and a poisoned sample ``(step, tokens)`` on every rank, the fault on its rank."""
    install_noise(noise, model, ctx.rank)
    if poison is not None:
        setups.install_poison(model, *poison)
    if fault is None:
        return []
    return fault.install(model, optimizer=optimizer, guard=guard, rank=ctx.rank).records


@dataclass(frozen=True)
class Job:
    """A scenario resolved against the campaign defaults."""

    scenario: Scenario
    nodes: int
    gpus_per_node: int
    mode: str
    verify_every: int
    weights_every: int
    fault: Fault | None
    spec: JobSpec

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def resolve(scenario: Scenario, defaults: JobDefaults) -> Job:
    """Fill in what the scenario leaves to the campaign."""
    nodes = scenario.nodes or defaults.nodes
    per = scenario.gpus_per_node or defaults.gpus_per_node
    mode = scenario.mode or defaults.mode
    ve = scenario.verify_every or defaults.verify_every
    we = defaults.weights_every if defaults.weights_every is not None else ve
    fault = scenario.fault
    if fault is not None:
        rank = fault.rank if fault.rank is not None else defaults.fault_rank
        fault = replace(fault, rank=rank % (nodes * per), seed=fault.seed or defaults.seed)
    tolerance = tolerance_overrides(
        scenario.tolerance_floor, scenario.tolerance_ceiling, scenario.sketch_block
    )
    guard = GuardConfig(
        verify_every=ve,
        weights_every=we,
        mode=mode,
        seed=defaults.seed,
        job_id=f"campaign-{scenario.name}",
        **tolerance,
    )
    poison = None
    if scenario.poison is not None:
        p = scenario.poison
        batch = synthetic_batch(
            defaults.model, step=p.step, rank=p.rank, batch=defaults.batch, seed=defaults.seed
        )
        if not -defaults.batch <= p.sample < defaults.batch:
            raise FaultConfigError(f"poisoned sample {p.sample} is outside a batch of {defaults.batch}")
        poison = (p.step, batch["tokens"][p.sample].clone())
    setup = functools.partial(install_for_campaign, fault=fault, noise=scenario.noise, poison=poison)
    spec = JobSpec(
        steps=defaults.steps,
        batch=defaults.batch,
        model=replace(defaults.model, checkpointing=scenario.checkpointing),
        guard=guard,
        loss=scenario.loss,
        seed=defaults.seed,
        setup=setup,
        parallel=scenario.parallel,
        replicas=nodes,
    )
    return Job(
        scenario=scenario,
        nodes=nodes,
        gpus_per_node=per,
        mode=mode,
        verify_every=ve,
        weights_every=we,
        fault=fault,
        spec=spec,
    )


@dataclass
class ScenarioOutcome:
    """What happened in one scenario (JSON-ready through :meth:`to_dict`)."""

    name: str
    title: str
    fault: dict[str, Any] | None
    nodes: int
    gpus_per_node: int
    mode: str
    verify_every: int
    weights_every: int
    steps: int
    expect: str
    onset: int | None
    first_corruption: int | None
    corruptions: int
    detected_at: int | None
    check: str | None
    checks_failed: list[str]
    suspect_ranks: list[int]
    suspect_nodes: list[str]
    fault_rank: int | None
    fault_node: str | None
    suspect_correct: bool | None
    classification: str | None
    applied_corrupted: list[int] | None
    false_alarms: int
    verifications: int
    verification_pairs: int
    weight_checks: int
    expected_by: int | None
    as_expected: bool
    seconds: float
    note: str = ""
    reference: str = ""
    error: str | None = None
    refusal: str | None = None
    verified_steps: list[int] = field(default_factory=list)
    losses: dict[str, list[float | None]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    incident: dict[str, Any] | None = None

    @property
    def applied_count(self) -> int:
        if not self.applied_corrupted:
            return 0
        return self.applied_corrupted[1] - self.applied_corrupted[0] + 1

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["applied_count"] = self.applied_count
        return d


def first_check_at_or_after(step: int, every: int) -> int:
    return -(-step // every) * every


def _steps_run(results: Sequence[JobResult]) -> int:
    return max(r.last_step for r in results) + 1


def evaluate(job: Job, results: Sequence[JobResult], seconds: float) -> ScenarioOutcome:
    """Turn the ranks' results into the row: detection, latency, suspect, false alarms."""
    sc, fault = job.scenario, job.fault
    incident = next((r.incident for r in results if r.incident is not None), None)
    records: list[Corruption] = [c for r in results for c in (r.setup_result or [])]
    first = min((c.step for c in records), default=None)
    detected = incident["step"] if incident else None
    onset = fault.onset if fault is not None else None
    last_applied = (detected - 1) if detected is not None else _steps_run(results) - 1
    applied = [first, last_applied] if first is not None and first <= last_applied else None
    poison = sc.poison
    data_step = poison.step if poison is not None else None
    false_alarm = int(detected is not None and detected != data_step and (first is None or detected < first))
    suspects = list(incident["suspect_ranks"]) if incident else []
    nodes = list(incident["suspect_nodes"]) if incident else []
    rank = fault.rank if fault is not None else (poison.rank if poison is not None else None)
    fault_node = results[rank].node if rank is not None else None
    correct = (
        (suspects == [rank])
        if incident is not None and fault is not None and rank is not None and not false_alarm
        else None
    )
    verified = sorted(results[0].verified_steps)
    steps_done = last_applied + 1
    weight_checks = len([s for s in range(steps_done) if job.weights_every and s % job.weights_every == 0])
    if detected is not None and job.weights_every and detected % job.weights_every == 0:
        weight_checks += 1  # the failing step's comparison ran too
    expected_by = None
    if sc.expect == "detect" and onset is not None:
        expected_by = min(
            first_check_at_or_after(onset, job.verify_every),
            first_check_at_or_after(onset, job.weights_every) if job.weights_every else 10**9,
        )
    if sc.expect == "detect":
        ok = (
            detected is not None
            and expected_by is not None
            and onset is not None
            and onset <= detected <= expected_by
            and bool(correct)
            and not false_alarm
        )
    elif sc.expect == "undetected":
        ok = detected is None and bool(records)
    elif sc.expect == "data":
        ok = (
            incident is not None
            and detected == data_step
            and incident["classification"] == "data"
            and not suspects
            and not nodes
            and not incident["candidates"]
            and not controller_actions(incident)
        )
    else:
        ok = detected is None
    losses = {str(r.rank): [r.losses.get(s) for s in range(_steps_run(results))] for r in results}
    return ScenarioOutcome(
        **_identity(sc, job),
        onset=onset if poison is None else data_step,
        first_corruption=first,
        corruptions=len(records),
        detected_at=detected,
        check=incident["check"] if incident else None,
        checks_failed=list(incident.get("checks_failed", [])) if incident else [],
        suspect_ranks=suspects,
        suspect_nodes=nodes,
        fault_rank=rank,
        fault_node=fault_node,
        suspect_correct=correct,
        classification=incident["classification"] if incident else None,
        applied_corrupted=applied,
        false_alarms=false_alarm,
        verifications=len(verified),
        verification_pairs=len(verified) * job.world,
        weight_checks=weight_checks,
        expected_by=expected_by,
        as_expected=ok,
        seconds=round(seconds, 2),
        note=sc.note,
        reference=sc.reference,
        verified_steps=verified,
        losses=losses,
        records=[c.to_dict() for c in records[:_MAX_RECORDS]],
        incident=incident,
    )


def _identity(sc: Scenario, job: Job) -> dict[str, Any]:
    """The outcome's fields that say which scenario ran and how, whatever happened to it."""
    return {
        "name": sc.name,
        "title": sc.title,
        "fault": _describe(job.fault),
        "nodes": job.nodes,
        "gpus_per_node": job.gpus_per_node,
        "mode": job.mode,
        "verify_every": job.verify_every,
        "weights_every": job.weights_every,
        "steps": job.spec.steps,
        "expect": sc.expect,
    }


def _describe(fault: Fault | None) -> dict[str, Any] | None:
    if fault is None:
        return None
    return {
        "where": fault.where.describe() if fault.where else None,
        "when": fault.when.describe(),
        "what": fault.what.describe(),
        "rank": fault.rank,
        "seed": fault.seed,
        "text": fault.describe(),
    }


def controller_actions(incident: dict[str, Any]) -> list[str]:
    """What the controller would do first about ``incident`` (auto-approval on) once the job's
    allocation is verified: its actions. The campaign's job ran where its incident says, so the
    named nodes stand in for the allocation the backend would report (the read-only check itself
    is left out: it changes nothing)."""
    from replicheck.controller.machine import initial_record, transition
    from replicheck.controller.model import Tick
    from replicheck.incident import Incident

    first = initial_record(Incident.from_dict(incident), vouched_by="campaign")
    record = first.evolve(allocation=first.targets)
    step = transition(record, Tick(now=incident["time"], auto_approve=True))
    return [type(a).__name__ for a in step.actions]


def evaluate_refused(job: Job, messages: Sequence[str], seconds: float) -> ScenarioOutcome:
    """A ``refused`` row: every rank refused at construction with the same message naming the setup."""
    sc = job.scenario
    ok = all(m == messages[0] for m in messages) and messages[0] != "accepted" and sc.refusal in messages[0]
    return _blank(
        sc,
        job,
        seconds,
        as_expected=ok,
        check="refused at construction" if messages[0] != "accepted" else None,
        refusal=messages[0],
    )


def _blank(sc: Scenario, job: Job, seconds: float, **kw: Any) -> ScenarioOutcome:
    """A row with nothing trained: a refused setup, or a scenario that broke."""
    fields: dict[str, Any] = {
        "onset": job.fault.onset if job.fault else None,
        "first_corruption": None,
        "corruptions": 0,
        "detected_at": None,
        "check": None,
        "checks_failed": [],
        "suspect_ranks": [],
        "suspect_nodes": [],
        "fault_rank": job.fault.rank if job.fault else None,
        "fault_node": None,
        "suspect_correct": None,
        "classification": None,
        "applied_corrupted": None,
        "false_alarms": 0,
        "verifications": 0,
        "verification_pairs": 0,
        "weight_checks": 0,
        "expected_by": None,
        "as_expected": False,
        "seconds": round(seconds, 2),
        "note": sc.note,
        "reference": sc.reference,
    }
    fields.update(kw)
    return ScenarioOutcome(**_identity(sc, job), **fields)


def run_scenario(scenario: Scenario, defaults: JobDefaults) -> ScenarioOutcome:
    """Run one scenario as a local multi-process job and evaluate it."""
    job = resolve(scenario, defaults)
    started = time.monotonic()
    nodes = node_names(job.nodes, job.gpus_per_node)
    try:
        if scenario.refuse is not None:
            messages = run_local(
                setups.construct, nodes, args=(job.spec, scenario.refuse), timeout=defaults.timeout
            )
            return evaluate_refused(job, messages, time.monotonic() - started)
        results = run_local(train, nodes, args=(job.spec,), timeout=defaults.timeout)
    except Exception as exc:  # noqa: BLE001 - a broken scenario is a row with its error, not a crash
        return _blank(scenario, job, time.monotonic() - started, error=str(exc)[-2000:])
    return evaluate(job, results, time.monotonic() - started)


def run_campaign(
    scenarios: Sequence[Scenario],
    defaults: JobDefaults,
    on_done: Callable[[ScenarioOutcome], None] | None = None,
) -> list[ScenarioOutcome]:
    """Run every scenario in order; ``on_done`` is called after each (progress bars)."""
    outcomes = []
    for sc in scenarios:
        out = run_scenario(sc, defaults)
        outcomes.append(out)
        if on_done is not None:
            on_done(out)
    return outcomes
