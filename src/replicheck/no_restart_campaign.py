"""``replicheck campaign --no-restart``: the campaign's no-restart rows (issue 28;
``docs/no-restart.md``, "Campaign").

Each scenario is a real run on this machine: torchft replica groups of one rank each, each its own
process, the real lighthouse, :class:`~replicheck.integrations.torchft.TorchftGuard` in exact mode.
The groups, the lighthouse and the records are the no-restart demo's (``replicheck.demo_no_restart``).
A persistent or transient fault sends its group out and the others go on (0 steps lost, no
checkpoint read); an ambiguous verdict (2 groups, or a second fault once 2 are left) is today's
stop, every group exiting 87, and the fallback is run too: today's resume from the newest verified
checkpoint, whose steps lost and checkpoint read are counted.

Not in ``replicheck.campaign``: it drives the demo's processes, which sit above the campaign.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.demo import DemoError
from replicheck.demo_no_restart import (
    EXIT_SUSPECT,
    FAULTY,
    _committed,
    _lighthouse,
    _Member,
    _record,
    _start,
    _wait,
)

SECTION = "## No restart (torchft)"
"""The heading of the section this writes into ``results.md``."""


@dataclass(frozen=True, kw_only=True)
class NoRestartScenario:
    """One no-restart row."""

    name: str
    """The row's name."""
    groups: int
    """Replica groups started (one rank each)."""
    fault: str
    """``persistent``, ``transient`` (one step) or ``second`` (persistent on group 1, then
    persistent on group 2 from ``second_onset``)."""
    onset: int
    """The (first) fault's first step, on group 1."""
    second_onset: int | None = None
    """The second fault's first step, on group 2 (``second`` only)."""
    expect: str = "group out"
    """``group out`` or ``stop + resume``."""


@dataclass(frozen=True, kw_only=True)
class NoRestartCampaign:
    """How long each no-restart scenario trains."""

    steps: int = 24
    """Planned training length (steps 0..steps-1)."""
    verify_every: int = 5
    """The guard's replay and weight-check period."""
    timeout_s: float = 120.0
    """Longest wait for one run's processes."""


def no_restart_scenarios(c: NoRestartCampaign) -> list[NoRestartScenario]:
    """The four rows: onsets placed from ``verify_every`` so the detections fall inside ``steps``."""
    v = c.verify_every
    return [
        NoRestartScenario(name="no-restart-persistent", groups=3, fault="persistent", onset=v + 2),
        NoRestartScenario(name="no-restart-transient", groups=3, fault="transient", onset=2 * v),
        NoRestartScenario(
            name="no-restart-ambiguous", groups=2, fault="persistent", onset=v + 2, expect="stop + resume"
        ),
        NoRestartScenario(
            name="no-restart-second-fault",
            groups=3,
            fault="second",
            onset=v + 2,
            second_onset=3 * v + 2,
            expect="stop + resume",
        ),
    ]


def _detect(onset: int, every: int) -> int:
    return -(-onset // every) * every


def run_no_restart_campaign(
    c: NoRestartCampaign, root: Path, on_done: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Run every scenario under ``root`` (one folder each); one row per scenario."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise DemoError("--no-restart needs torchft: pip install 'replicheck[torchft]'")
    rows = []
    for sc in no_restart_scenarios(c):
        t0 = time.monotonic()
        try:
            row = _run(sc, c, root / sc.name)
        except Exception as exc:  # a row that failed is reported as such, not lost
            row = {"scenario": sc.name, "error": f"{type(exc).__name__}: {exc}", "as_expected": False}
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        if on_done is not None:
            on_done(row)
    return rows


def _members(
    sc: NoRestartScenario, c: NoRestartCampaign, base: Path, lighthouse: str, **kw: Any
) -> list[_Member]:
    checkpoint = None
    if sc.expect == "stop + resume":
        last = sc.second_onset if sc.second_onset is not None else sc.onset
        kw["checkpoint_step"] = _detect(last, c.verify_every) - c.verify_every
        checkpoint = str(base / "checkpoint.pt")
    onsets = {FAULTY: sc.onset}
    if sc.second_onset is not None:
        onsets[2] = sc.second_onset
    return [
        _Member(
            shard=i,
            name=f"group{i}",
            lighthouse=lighthouse,
            records=str(base / "records"),
            incidents=str(base / "incidents"),
            steps=c.steps,
            verify_every=c.verify_every,
            # 2 groups: 1 (a departure is refused anyway: ambiguous); 3 groups: 2 lets one leave.
            min_size=1 if sc.groups == 2 else 2,
            fault_onset=onsets.get(i),
            fault_transient=sc.fault == "transient",
            checkpoint=checkpoint,
            timeout_s=c.timeout_s,
            **kw,
        )
        for i in range(sc.groups)
    ]


def _run(sc: NoRestartScenario, c: NoRestartCampaign, base: Path) -> dict[str, Any]:
    for d in ("records", "incidents"):
        (base / d).mkdir(parents=True)
    lighthouse = _lighthouse(min_replicas=2)
    try:
        members = _members(sc, c, base, lighthouse.address())
        procs = _start(members)
        _wait(procs, c.timeout_s)
    finally:
        lighthouse.shutdown()
    recs = [_record(base / "records", m.name) for m in members]
    exits = [p.exitcode for p in procs]
    flagged = [a for r in recs for a in r["attempts"] if a["incident"] is not None]
    stops = [r["stopped"] for r in recs if "stopped" in r]
    first_onset = sc.onset
    false_alarms = sum(1 for a in flagged if a["step"] < first_onset) + sum(
        1 for s in stops if s["step"] < first_onset
    )
    row: dict[str, Any] = {
        "scenario": sc.name,
        "fault": _describe(sc),
        "groups": sc.groups,
        "onset": sc.onset if sc.second_onset is None else [sc.onset, sc.second_onset],
        "exitcodes": exits,
        "false_alarms": false_alarms,
        "expected": sc.expect,
    }
    if stops:
        # Today's stop: every group exits 87; the fallback is today's resume, run here.
        detect = min(s["step"] for s in stops)
        t_detect = min(s["t"] for s in stops)
        classes = sorted({s["classification"] for s in stops})
        left = [a for a in flagged if a["classification"] in ("persistent", "transient")]
        row.update(
            detected_at=[left[0]["step"], detect] if left else detect,
            classification=" then ".join([*(sorted({a["classification"] for a in left})), *classes]),
            # Right: the group that left (if any) was group 1, and the ambiguous verdict names no one.
            suspect_right=(not left or _suspects_right(left))
            and not any(a["suspects"] for a in flagged if a not in left),
            named_first=bool(left),
            what="stop + resume" if all(e == EXIT_SUSPECT for e in exits) else f"stop (exits {exits})",
        )
        row.update(_resume(sc, c, base, detect, t_detect))
    else:
        detect = flagged[0]["step"] if flagged else None
        survivors = [r for i, r in enumerate(recs) if i != FAULTY]
        t_detect = min(
            (a["t"] for r in survivors for a in r["attempts"] if a["incident"] is not None), default=None
        )
        t_next = min((a["t"] for r in survivors for a in _committed(r) if a["step"] == detect), default=None)
        committed = [[a["step"] for a in _committed(r)] for r in survivors]
        row.update(
            detected_at=detect,
            classification=flagged[0]["classification"] if flagged else None,
            suspect_right=_suspects_right(flagged),
            what="group out"
            if exits[FAULTY] == EXIT_SUSPECT and all(e == 0 for i, e in enumerate(exits) if i != FAULTY)
            else f"exits {exits}",
            steps_lost=len(set(range(c.steps)) - set(committed[0])) if committed else c.steps,
            every_step_once=all(s == list(range(c.steps)) for s in committed),
            checkpoints_read=sum(1 for r in recs if "checkpoint_read" in r),
            detection_to_next_commit_s=round(t_next - t_detect, 3) if t_next and t_detect else None,
        )
    row["as_expected"] = _as_expected(sc, c, row)
    return row


def _suspects_right(flagged: list[dict[str, Any]]) -> bool:
    return bool(flagged) and all(list(a["suspects"] or []) == [f"group{FAULTY}"] for a in flagged)


def _resume(
    sc: NoRestartScenario, c: NoRestartCampaign, base: Path, detect: int, t_detect: float
) -> dict[str, Any]:
    """Today's fallback: restart every group (the suspects replaced) from the newest verified
    checkpoint and train until the detected step is committed again."""
    ckpt = base / "checkpoint.pt"
    if not ckpt.exists():
        raise DemoError(f"{sc.name}: no verified checkpoint was written")
    # The restarted job: as many groups as the stopped one, none faulty.
    n = sc.groups
    again = base / "resume"
    for d in ("records", "incidents"):
        (again / d).mkdir(parents=True)
    lighthouse = _lighthouse(min_replicas=n)
    try:
        members = [
            _Member(
                shard=i,
                name=f"group{i}-resumed",
                lighthouse=lighthouse.address(),
                records=str(again / "records"),
                incidents=str(again / "incidents"),
                steps=detect + 1,
                verify_every=c.verify_every,
                min_size=n,
                resume_from=str(ckpt),
                timeout_s=c.timeout_s,
            )
            for i in range(n)
        ]
        procs = _start(members)
        _wait(procs, c.timeout_s)
    finally:
        lighthouse.shutdown()
    resumed = [_record(again / "records", m.name) for m in members]
    firsts = [_committed(r)[0] for r in resumed]
    ckpt_step = {r["checkpoint_read"]["step"] for r in resumed if "checkpoint_read" in r}
    return {
        "resumed_at_step": firsts[0]["step"],
        "steps_lost": detect - firsts[0]["step"],
        # One checkpoint (the newest verified), read by every restarted group.
        "checkpoints_read": len(ckpt_step),
        "checkpoint_loads": sum(1 for r in resumed if "checkpoint_read" in r),
        "detection_to_next_commit_s": round(min(a["t"] for a in firsts) - t_detect, 3),
        "resume_exitcodes": [p.exitcode for p in procs],
    }


def _as_expected(sc: NoRestartScenario, c: NoRestartCampaign, row: dict[str, Any]) -> bool:
    if row["false_alarms"] or not row["suspect_right"]:
        return False
    if sc.expect == "group out":
        return (
            row["what"] == "group out"
            and row["steps_lost"] == 0
            and row["checkpoints_read"] == 0
            and row["detected_at"] == _detect(sc.onset, c.verify_every)
        )
    last = sc.second_onset if sc.second_onset is not None else sc.onset
    detect = _detect(last, c.verify_every)
    ckpt = detect - c.verify_every
    return (
        row["what"] == "stop + resume"
        and row["classification"].endswith("ambiguous")
        and row["steps_lost"] == detect - (ckpt + 1)
        and row["checkpoints_read"] == 1
        and row["checkpoint_loads"] == sc.groups
        and all(e == 0 for e in row["resume_exitcodes"])
    )


def _describe(sc: NoRestartScenario) -> str:
    if sc.fault == "second":
        return f"persistent on group 1 from step {sc.onset}, then on group 2 from step {sc.second_onset}"
    if sc.fault == "transient":
        return f"transient on group 1 at step {sc.onset} only"
    return f"persistent on group 1 from step {sc.onset}"


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, list):
        return " → ".join(str(x) for x in v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def markdown(rows: list[dict[str, Any]], c: NoRestartCampaign, command: str, wall_s: float) -> str:
    """The section (heading, command, table) for ``results.md``."""
    import torch

    head = [
        "scenario",
        "fault",
        "groups",
        "onset",
        "detected at",
        "classification",
        "suspect right?",
        "what happened",
        "steps lost",
        "checkpoints read",
        "detection → next committed step (s)",
        "false alarms",
        "as expected?",
    ]
    lines = [
        SECTION,
        "",
        "Made with:",
        "",
        "```",
        command,
        "```",
        "",
        f"torchft replica groups of one rank each (one process each), the real lighthouse, TorchftGuard in "
        f"exact mode; a small MLP, AdamW, {c.steps} steps (0–{c.steps - 1}), verify every {c.verify_every}; "
        f"the fault scales a forward value of group 1 (and of group 2 in the second-fault row) by 3. "
        f"An ambiguous stop is followed by today's resume from the newest verified checkpoint (run here: "
        f"the restarted groups train until the detected step is committed again); its steps lost are the "
        f"steps since that checkpoint, and its detection → next committed step runs from the stop to the "
        f"resumed job's first commit (a scheduler's restart time is not in it). Wall time {wall_s:.0f} s on 2 CPU cores, torch {torch.__version__}. "
        f"See docs/no-restart.md.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| `{r['scenario']}` | error: {' '.join(r['error'].split())[:200]} |"
                + " |" * (len(head) - 2)
            )
            continue
        if r["what"] == "group out":
            suspect = "yes: group1" if r["suspect_right"] else "no"
        elif r["suspect_right"]:
            suspect = "yes: group1, then none named" if r.get("named_first") else "none named (ambiguous)"
        else:
            suspect = "no"
        what = r["what"]
        if what == "stop + resume":
            what = f"stop (all exit 87) + resume from step {r['resumed_at_step']}"
        cells = [
            f"`{r['scenario']}`",
            r["fault"],
            r["groups"],
            r["onset"],
            r["detected_at"],
            r["classification"],
            suspect,
            what,
            r["steps_lost"],
            r["checkpoints_read"],
            r["detection_to_next_commit_s"],
            r["false_alarms"],
            r["as_expected"],
        ]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Put ``section`` into ``path`` in place of an earlier one (up to the next ``## `` heading), or
    before the first ``## `` heading after the main table; the rest of the file is kept as is."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == SECTION), None)
    if start is not None:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    else:
        start = end = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), len(lines))
    path.write_text("".join(lines[:start]) + section + "\n" + "".join(lines[end:]))
