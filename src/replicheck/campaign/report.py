"""Campaign outputs: ``results.json`` and the Markdown detection table (standard library only)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replicheck.incident import json_safe

REFERENCE_ROWS: tuple[tuple[str, str], ...] = (
    ("persistent fault from step 23 (verify every 10)", "caught at step 30, steps 23-29 applied"),
    ("backward-only weight-gradient fault, default kernels", "not caught in 50 steps"),
    ("one-shot finite fault on an unverified step", "not caught"),
    ("clean training", "0 false alarms in 15,320 verifications and 3,080 weight checks"),
)
"""The published reference figures (AWS, SageMaker HyperPod SDC detection)."""

COLUMNS = (
    "scenario",
    "fault (where / when / what)",
    "nodes × ranks",
    "mode",
    "onset step",
    "detected at",
    "steps applied while corrupted",
    "check that fired",
    "suspect right?",
    "classification",
    "false alarms",
    "as expected?",
)


def write_json(rows: Sequence[Mapping[str, Any]], path: Path, meta: Mapping[str, Any]) -> Path:
    """``{"meta": ..., "scenarios": [...]}`` as strict JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(json_safe({"meta": dict(meta), "scenarios": list(rows)}), indent=1, allow_nan=False)
    )
    return path


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _applied(row: Mapping[str, Any]) -> str:
    span = row.get("applied_corrupted")
    if not span:
        return "0"
    a, b = span
    n = b - a + 1
    return f"{n} ({a})" if a == b else f"{n} ({a}–{b})"


def _suspect(row: Mapping[str, Any]) -> str:
    if row.get("expect") == "data" and row.get("detected_at") is not None:
        return (
            "none named"
            if not row.get("suspect_ranks")
            else "NO: " + ", ".join(map(str, row["suspect_ranks"]))
        )
    if row.get("suspect_correct") is None:
        return "–"
    names = ", ".join(f"rank {r}" for r in row.get("suspect_ranks", [])) or "none"
    nodes = ", ".join(row.get("suspect_nodes", []))
    return f"{'yes' if row['suspect_correct'] else 'NO'}: {names} ({nodes})"


def _detected(row: Mapping[str, Any]) -> str:
    if row.get("refusal") is not None:
        return "refused at construction" if row.get("check") else "accepted"
    return "not detected" if row.get("detected_at") is None else str(row["detected_at"])


def row_cells(row: Mapping[str, Any]) -> list[str]:
    fault = row.get("fault")
    fault_text = "none" if not fault else f"{fault['where']} / {fault['when']} / {fault['what']}"
    expected = "yes" if row.get("as_expected") else "**NO**"
    if row.get("error"):
        expected = "**ERROR**"
    return [
        f"`{row['name']}`",
        fault_text,
        f"{row['nodes']} × {row['gpus_per_node']}",
        row["mode"] + (f", verify every {row['verify_every']}" if row["verify_every"] != 10 else ""),
        "–" if row.get("onset") is None else str(row["onset"]),
        _detected(row),
        _applied(row),
        row.get("check") or "–",
        _suspect(row),
        row.get("classification") or "–",
        str(row.get("false_alarms", 0)),
        expected,
    ]


def markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], plots: bool) -> str:
    """The detection table, the reference figures, notes per row and how it was made."""
    out = ["# Fault-injection campaign", ""]
    if meta.get("command"):
        out += ["Made with:", "", "```", str(meta["command"]), "```", ""]
    out += [
        f"Job: {meta.get('job', '')}. Wall time {meta.get('seconds', 0):.0f} s on {meta.get('cpus', '?')} "
        f"CPU cores, torch {meta.get('torch', '?')}.",
        "",
    ]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        out.append("| " + " | ".join(_cell(c) for c in row_cells(row)) + " |")
    out += [
        "",
        "Steps applied while corrupted: optimizer updates applied from the first corruption "
        "until the step before detection (or the end of the run); the replicas' state descends "
        "from each of them. Detection stops the update of the step it happens on.",
        "",
    ]
    out += ["## Published reference (AWS, SageMaker HyperPod)", "", "| case | published |", "|---|---|"]
    out += [f"| {a} | {b} |" for a, b in REFERENCE_ROWS]
    out += ["", "## Notes per scenario", ""]
    for row in rows:
        line = f"- `{row['name']}` — {row['title']}."
        if row.get("note"):
            line += f" {row['note'][0].upper()}{row['note'][1:]}."
        if row.get("reference"):
            line += f" Reference: {row['reference']}."
        line += f" {row.get('corruptions', 0)} corruption(s) recorded, {row.get('verifications', 0)} verification(s) passed."
        if row.get("refusal") is not None:
            line += f" Message on every rank: “{_cell(row['refusal'])}”"
        if row.get("error"):
            line += f" Error: `{_cell(row['error'][-300:])}`"
        if plots:
            line += f" [timeline]({row['name']}.png)"
        out.append(line)
    if not plots:
        out += [
            "",
            "Timeline plots were not made: install the `plot` extra (`pip install 'replicheck[plot]'`, "
            "i.e. matplotlib) and run the command again.",
        ]
    return "\n".join(out) + "\n"


def write_markdown(
    rows: Sequence[Mapping[str, Any]], path: Path, meta: Mapping[str, Any], plots: bool
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(rows, meta, plots))
    return path
