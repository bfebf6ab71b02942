"""The campaign's no-restart rows (issue 28): four real torchft runs, short, and their section."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicheck.no_restart_campaign import (
    SECTION,
    NoRestartCampaign,
    markdown,
    run_no_restart_campaign,
    write_section,
)


@pytest.mark.timeout(150)
def test_no_restart_rows_leave_or_stop_and_resume_as_documented(tmp_path: Path) -> None:
    """Persistent and transient faults send group 1 out with 0 steps lost and no checkpoint read;
    2 groups, and a second fault once 2 are left, are ambiguous: every group exits 87 and today's
    resume reads the one verified checkpoint and redoes the steps since it. The section replaces
    only itself in results.md."""
    c = NoRestartCampaign(steps=14, verify_every=3)
    rows = run_no_restart_campaign(c, tmp_path)
    by = {r["scenario"]: r for r in rows}
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    assert all(r["as_expected"] for r in rows), rows
    for name, cls in (("no-restart-persistent", "persistent"), ("no-restart-transient", "transient")):
        r = by[name]
        assert (r["what"], r["classification"], r["detected_at"], r["exitcodes"]) == (
            "group out",
            cls,
            6,
            [0, 87, 0],
        )
        assert (r["steps_lost"], r["checkpoints_read"], r["every_step_once"], r["false_alarms"]) == (
            0,
            0,
            True,
            0,
        )
    amb = by["no-restart-ambiguous"]
    assert (amb["classification"], amb["exitcodes"], amb["detected_at"]) == ("ambiguous", [87, 87], 6)
    # Checkpoint after step 3, resumed at 4: steps 4 and 5 redone.
    assert (amb["resumed_at_step"], amb["steps_lost"], amb["checkpoints_read"], amb["checkpoint_loads"]) == (
        4,
        2,
        1,
        2,
    )
    sec = by["no-restart-second-fault"]
    assert (sec["detected_at"], sec["classification"], sec["exitcodes"]) == (
        [6, 12],
        "persistent then ambiguous",
        [87, 87, 87],
    )
    assert (sec["resumed_at_step"], sec["steps_lost"], sec["checkpoints_read"]) == (10, 2, 1)

    results = tmp_path / "results.md"
    results.write_text("# Campaign\n\n| main table |\n\n## Published reference\n\nkept\n")
    for _ in range(2):  # a second write replaces the section, never duplicates it
        write_section(results, markdown(rows, c, "replicheck campaign --no-restart", 1.0))
    text = results.read_text()
    assert text.count(SECTION) == 1 and "| main table |" in text and text.endswith("kept\n")
    assert text.index(SECTION) < text.index("## Published reference")
    assert "| `no-restart-ambiguous` | persistent on group 1 from step 5 | 2 | 5 | 6 | ambiguous |" in text
