"""The whole story on one machine: detect, cordon, triage, approve, replace, resume, prove.

A local cluster of simulated nodes (plus spares) trains the small decoder with DDP/gloo under
the guard, checkpointing as it goes; a fault from a campaign scenario hits one rank; the
incident goes to the controller (``local`` backend in SQLite); after approval the node is
replaced by a spare and the job resumes from the verified checkpoint. Finally the resumed run's
weights are compared bit for bit with a clean run of the same length.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from replicheck.campaign.runner import Job, resolve
from replicheck.campaign.scenarios import JobDefaults, Scenario, default_scenarios, select
from replicheck.checkpoint import CheckpointStore
from replicheck.controller import Controller, ControllerConfig, LocalBackend
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import node_names, run_local
from replicheck.incident import Incident, write_incident


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs."""

    scenario: str = "aws-persistent-3n"
    """Campaign scenario to play (``replicheck campaign`` lists them)."""
    out_dir: str = "demo-out"
    """Where the checkpoints, incidents, controller database, PNG and JSON go: created, or an
    empty directory, or one an earlier demo made (only what that demo created is removed)."""
    steps: int = 40
    """Training length in steps."""
    nodes: int = 3
    """Simulated nodes running the job."""
    spares: int = 1
    """Simulated spare nodes the controller may swap in."""
    checkpoint_every: int = 5
    """Verified checkpoint period."""
    approve: Callable[[str], bool] | None = None
    """Asks a person to approve a replacement (given the prompt); ``None``: approve automatically."""
    approver: str = "demo --yes"
    """Name recorded for the approval."""


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.timeline: list[dict[str, Any]] = []

    def __call__(self, what: str, text: str, **facts: Any) -> None:
        t = time.monotonic() - self.t0
        self.out.write(f"[{t:6.1f}s] {what:<11} {text}\n")
        self.out.flush()
        self.timeline.append({"t": round(t, 2), "what": what, "text": text, **facts})


def _scenario(name: str) -> Scenario:
    return select(default_scenarios(), name)[0]


@dataclass(frozen=True)
class _Plan:
    """The demo's job, resolved from its scenario."""

    root: Path
    """Output directory."""
    job: Job
    """The campaign job resolved from the scenario."""
    spec: JobSpec
    """The training job run first (with the fault)."""
    guard: GuardConfig
    """The guard configuration of that job."""

    @property
    def scenario(self) -> Scenario:
        """The scenario played."""
        return self.job.scenario

    @property
    def ranks_nodes(self) -> list[str]:
        """Node of every rank, named as the campaign names them."""
        return node_names(self.job.nodes, self.job.gpus_per_node)

    @property
    def names(self) -> list[str]:
        """The job's simulated nodes."""
        return list(dict.fromkeys(self.ranks_nodes))

    @property
    def fault_rank(self) -> int | None:
        """The rank the fault hits, if any (``resolve`` gives every fault one)."""
        return self.job.fault.rank if self.job.fault is not None else None


def run_demo(config: DemoConfig, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Play the scenario; return the facts (also written to ``out_dir/demo.json``)."""
    say = _Printer(out)
    plan = _prepare(config, say)
    backend, spare_names = _cluster(plan, config)
    t_job = time.monotonic()
    say("train", f"job demo-job starts on {', '.join(plan.names)}")
    first = run_local(train, plan.ranks_nodes, args=(plan.spec,), timeout=900)
    facts: dict[str, Any] = {
        "scenario": plan.scenario.name,
        "nodes": plan.names,
        "spares": spare_names,
        "fault_rank": plan.fault_rank,
        "fault_node": plan.ranks_nodes[plan.fault_rank] if plan.fault_rank is not None else None,
    }
    if first[0].incident is None:
        _undetected(plan, say, first, facts)
        return _finish(plan.root, say, facts, config, first, None)

    incident = _recommend(plan, say, Incident.from_dict(first[0].incident))
    first_job_s = time.monotonic() - t_job
    transitions, requests = _control(plan, say, backend, incident, config)
    facts.update(detected=True, incident=incident.to_dict(), transitions=transitions)
    if not requests:
        say("result", "not resumed (replacement not approved)")
        facts.update(final_equal=None)
        return _finish(plan.root, say, facts, config, first, None)

    second, replaced, resume_s = _resume(plan, say, incident, requests[-1])
    equal = _states_equal(second, _clean_run(say, plan.spec, plan.guard, plan.job, plan.ranks_nodes))
    say(
        "proof",
        (
            "final weights are bit-for-bit identical to a clean run of the same length"
            if equal
            else "final weights DIFFER from the clean run"
        ),
    )
    facts.update(
        resumed_from=second[0].resumed_from,
        final_step=second[0].last_step,
        final_equal=equal,
        replacement=replaced,
        first_job_s=round(first_job_s, 1),
        resume_s=round(resume_s, 1),
        recomputed_steps=(incident.step - (second[0].resumed_from or 0) - 1),
    )
    return _finish(plan.root, say, facts, config, first, second)


MARKER = ".replicheck-demo"
"""File in the output directory recording what the demo created there (and what it found)."""


class DemoError(ValueError):
    """The demo cannot run with these arguments (nothing was deleted)."""


def _claim_out_dir(root: Path) -> None:
    """Make ``root`` the demo's: create it, or take an empty one, or clear what an earlier demo
    created in it. A non-empty directory the demo did not make is refused; nothing else is
    ever deleted (not the directory itself, nor files someone put next to the demo's)."""
    import shutil

    if root.exists() and not root.is_dir():
        raise DemoError(f"--out {root}: exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    marker = root / MARKER
    if marker.is_file():
        try:
            record = json.loads(marker.read_text())
            found = set(record["found"])
            created = record.get("created")
        except (ValueError, KeyError, TypeError) as exc:
            raise DemoError(f"--out {root}: unreadable {MARKER} ({exc}); remove it by hand") from exc
        names = {p.name for p in root.iterdir()} - {MARKER}
        # A run that finished listed what it made; one that crashed made everything not found.
        ours = (set(created) if created is not None else names - found) & names
        for name in sorted(ours):
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        found = {p.name for p in root.iterdir()} - {MARKER}  # what stays is not the demo's
    else:
        found = {p.name for p in root.iterdir()}
        if found:
            raise DemoError(
                f"--out {root}: directory is not empty and was not made by replicheck demo; "
                "give a new or empty directory"
            )
    marker.write_text(json.dumps({"found": sorted(found), "created": None}))


def _seal_out_dir(root: Path) -> None:
    """Record what this run created, so the next run removes exactly that."""
    marker = root / MARKER
    found = set(json.loads(marker.read_text())["found"])
    created = sorted({p.name for p in root.iterdir()} - found - {MARKER})
    marker.write_text(json.dumps({"found": sorted(found), "created": created}))


def _prepare(config: DemoConfig, say: _Printer) -> _Plan:
    """A fresh output directory and the scenario's job, with checkpoints and incidents in it."""
    scenario = _scenario(config.scenario)  # validated before anything on disk is touched
    root = Path(config.out_dir)
    _claim_out_dir(root)
    (root / "incidents").mkdir()
    job = resolve(scenario, JobDefaults(nodes=config.nodes, gpus_per_node=1, steps=config.steps))
    if job.spec.guard is None:
        raise ValueError(f"scenario {scenario.name!r} runs no guard")
    # The demo writes the incident itself, annotated with its checkpoint (_recommend), as a job
    # with a checkpoint store does: incident files are never overwritten, so the guard writes none.
    guard = dataclasses.replace(job.spec.guard, incident_dir=None, job_id="demo-job")
    spec = dataclasses.replace(
        job.spec,
        guard=guard,
        checkpoint_dir=str(root / "checkpoints"),
        checkpoint_every=config.checkpoint_every,
        stop_step=config.steps,
        keep_state=True,
        report_every=5,
    )
    plan = _Plan(root=root, job=job, spec=spec, guard=guard)
    say(
        "cluster",
        f"{job.nodes} nodes x {job.gpus_per_node} rank(s) ({', '.join(plan.names)}) + {config.spares} spare; "
        f"DDP/gloo, guard {job.mode} mode, replay every {job.verify_every}, weights every {job.weights_every}, "
        f"checkpoint every {config.checkpoint_every}",
    )
    rank = plan.fault_rank
    if job.fault is not None and rank is not None:
        say("fault", f"{scenario.title}: rank {rank} on {plan.ranks_nodes[rank]} ({job.fault.describe()})")
    return plan


def _cluster(plan: _Plan, config: DemoConfig) -> tuple[LocalBackend, list[str]]:
    """The controller's local backend with the job's nodes and the spares."""
    backend = LocalBackend(plan.root / "controller.db")
    for n in plan.names:
        backend.add_node(n)
    backend.add_job("demo-job", plan.names)  # the allocation the controller checks incidents against
    spare_names = [f"spare{i}" for i in range(config.spares)]
    for n in spare_names:
        backend.add_node(n, spare=True)
    return backend, spare_names


def _undetected(plan: _Plan, say: _Printer, first: list[JobResult], facts: dict[str, Any]) -> None:
    """No incident: with a fault, prove by a clean run whether it changed the weights."""
    say("result", f"no incident; training reached step {first[0].last_step}")
    equal = None
    if plan.job.fault is not None:
        equal = _states_equal(first, _clean_run(say, plan.spec, plan.guard, plan.job, plan.ranks_nodes))
        say(
            "proof",
            "final weights equal a clean run's: the fault changed nothing"
            if equal
            else "final weights DIFFER from a clean run: the fault went undetected (see the scenario's note)",
        )
    facts.update(detected=False, final_equal=equal, note=plan.scenario.note)


def _recommend(plan: _Plan, say: _Printer, incident: Incident) -> Incident:
    """The incident with its recommended checkpoint, written where the controller reads it."""
    # Absolute, as the controller's checkpoint_roots require (--out may be relative).
    incident = CheckpointStore((plan.root / "checkpoints").resolve()).annotate(incident)
    write_incident(incident, plan.root / "incidents")
    rc = incident.recommended_checkpoint or {}
    say(
        "incident",
        f"step {incident.step}: check {incident.check!r} names rank(s) {list(incident.suspect_ranks)} "
        f"on {list(incident.suspect_nodes)} ({incident.classification}); update of step {incident.step} "
        f"NOT applied; last passing verification {incident.last_verified_step}; "
        f"recommended checkpoint: step {rc.get('step')}",
        incident=incident.to_dict(),
    )
    return incident


def _control(
    plan: _Plan, say: _Printer, backend: LocalBackend, incident: Incident, config: DemoConfig
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The controller cordons, triages and, once approved, replaces: ``(transitions, resume requests)``."""
    for n in incident.suspect_nodes:
        backend.set_healthy(n, False)  # the simulated bad hardware also fails its self-test
    ctl_cfg = ControllerConfig(
        apply=True,
        auto_approve=False,
        triage_persistent=True,
        incident_dirs=(str(plan.root / "incidents"),),
        checkpoint_roots=(str((plan.root / "checkpoints").resolve()),),
        retry_base_delay_s=0.0,
    )
    transitions: list[dict[str, Any]] = []

    def on_transition(t: Any) -> None:
        transitions.append({"from": t.from_state.value, "to": t.to_state.value, "reason": t.reason})
        say("controller", f"{t.from_state.value} -> {t.to_state.value}: {t.reason}")

    with Controller(
        plan.root / "controller.db", backend=backend, config=ctl_cfg, on_transition=on_transition
    ) as ctl:
        ctl.ingest_dir(plan.root / "incidents")
        _settle(ctl)
        record = next(r for r in ctl.records() if r.incident_id == incident.id)
        if record.state.value == "awaiting_approval":
            _approve(ctl, say, incident, config)
            _settle(ctl)
        return transitions, list(backend.resume_requests())


def _approve(ctl: Controller, say: _Printer, incident: Incident, config: DemoConfig) -> None:
    prompt = f"Replace node(s) {', '.join(incident.suspect_nodes)} (incident {incident.id})? [y/N] "
    if config.approve is None:
        say(
            "approval",
            f"no person at the terminal: approved automatically as {config.approver!r} "
            "(run interactively to be asked)",
        )
        ctl.approve(incident.id, by=config.approver)
    elif config.approve(prompt):
        ctl.approve(incident.id, by=config.approver)
    else:
        ctl.dismiss(incident.id, by=config.approver)


def _resume(
    plan: _Plan, say: _Printer, incident: Incident, req: Any
) -> tuple[list[JobResult], dict[str, str], float]:
    """The job again on the replacement nodes, from the recommended checkpoint."""
    replaced = dict(zip(incident.suspect_nodes, [n for n in req.nodes if n not in plan.names]))
    new_nodes = [replaced.get(n, n) for n in plan.ranks_nodes]
    say(
        "resume",
        f"job {req.job_id} resumes from checkpoint step {(req.checkpoint or {}).get('step')} on "
        f"{', '.join(dict.fromkeys(new_nodes))} (excluded: {', '.join(req.exclude) or 'none'})",
    )
    resumed_spec = dataclasses.replace(
        plan.spec, setup=_clean_setup(plan.job), resume=True, resume_incident=incident.to_json()
    )
    t_resume = time.monotonic()
    second = run_local(train, new_nodes, args=(resumed_spec,), timeout=900)
    resume_s = time.monotonic() - t_resume
    say("resumed", f"training finished at step {second[0].last_step} (resumed from {second[0].resumed_from})")
    return second, replaced, resume_s


def _clean_run(
    say: _Printer, spec: JobSpec, guard: GuardConfig, job: Job, nodes: list[str]
) -> list[JobResult]:
    """The same job without the fault, from scratch, for the bit-for-bit comparison."""
    say("reference", "training a clean run of the same length for the bit-for-bit comparison")
    clean_spec = dataclasses.replace(
        spec,
        setup=_clean_setup(job),
        checkpoint_dir=None,
        report_every=0,
        guard=dataclasses.replace(guard, incident_dir=None),
    )
    return run_local(train, nodes, args=(clean_spec,), timeout=900)


def _clean_setup(job: Job) -> Any:
    """The scenario's setup without the fault (kernel noise, if any, stays: it is not a fault)."""
    import functools

    from replicheck.campaign.runner import install_for_campaign

    return functools.partial(install_for_campaign, fault=None, noise=job.scenario.noise)


def _settle(ctl: Controller, passes: int = 50) -> None:
    for _ in range(passes):
        if not ctl.reconcile():
            return


def _states_equal(a: list[JobResult], b: list[JobResult]) -> bool:
    import torch

    for x, y in zip(a, b):
        if x.state is None or y.state is None or x.state.keys() != y.state.keys():
            return False
        if not all(torch.equal(x.state[k], y.state[k]) for k in x.state):
            return False
    return True


def _finish(
    root: Path,
    say: _Printer,
    facts: dict[str, Any],
    config: DemoConfig,
    first: list[JobResult],
    second: list[JobResult] | None,
) -> dict[str, Any]:
    facts["summary"] = _summary(facts)
    say("summary", facts["summary"])
    facts["timeline"] = say.timeline
    facts["losses"] = {"first": first[0].losses, "resumed": second[0].losses if second else {}}
    png = _plot(root, facts, first, second)
    facts["png"] = str(png) if png else None
    path = root / "demo.json"
    path.write_text(json.dumps(facts, indent=2, default=str))
    _seal_out_dir(root)
    say(
        "files",
        f"{path}, {root / 'incidents'}"
        + (f", {png}" if png else " (pip install 'replicheck[plot]' for the PNG)"),
    )
    return facts


def _summary(f: dict[str, Any]) -> str:
    if not f.get("detected"):
        if f.get("final_equal") is False:
            return (
                "No incident was raised, and the final weights differ from a clean run: this fault "
                f"went undetected. {f.get('note', '')}".strip()
            )
        return "No incident was raised in this scenario, and nothing was lost."
    inc = f["incident"]
    onset = 23 if f["scenario"].startswith("aws") else None
    applied = (
        f"steps {onset}-{inc['step'] - 1} were applied before detection, as in the reference; "
        if onset
        else ""
    )
    equal = {
        True: "the final weights equal a clean run's bit for bit",
        False: "the final weights differ from a clean run",
        None: "the job was not resumed",
    }[f.get("final_equal")]
    cost = (
        f" Resume cost: {f.get('recomputed_steps')} steps recomputed from checkpoint {f.get('resumed_from')}."
        if f.get("resumed_from") is not None
        else ""
    )
    return (
        f"Published reference (AWS HyperPod method): persistent fault from step 23 caught at step 30, steps "
        f"23-29 applied. Here: caught at step {inc['step']} by the {inc['check']} check, rank "
        f"{inc['suspect_ranks']} on {inc['suspect_nodes']} named ({inc['classification']}), "
        f"step {inc['step']}'s update withheld; {applied}the controller cordoned, triaged and replaced the "
        f"node after approval, and {equal}.{cost}"
    )


def _plot(
    root: Path, facts: dict[str, Any], first: list[JobResult], second: list[JobResult] | None
) -> Path | None:
    from replicheck.campaign import plots

    if not plots.available():
        return None
    steps = (
        max([max(first[0].losses, default=-1)] + ([max(second[0].losses, default=-1)] if second else [])) + 1
    )
    series = {}
    for r in first:
        vals: list[float | None] = [None] * steps
        for s, v in r.losses.items():
            vals[s] = v
        series[str(r.rank)] = vals
    inc = facts.get("incident") or {}
    row = {
        "name": facts["scenario"],
        "title": "demo: first run (before the incident)",
        "losses": series,
        "fault_rank": facts.get("fault_rank"),
        "verified_steps": first[0].verified_steps,
        "onset": 23 if facts["scenario"].startswith("aws") else None,
        "detected_at": inc.get("step"),
        "check": inc.get("check"),
        "applied_corrupted": [23, inc["step"] - 1] if inc and facts["scenario"].startswith("aws") else None,
    }
    return plots.timeline(row, root / "timeline.png")
