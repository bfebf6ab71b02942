"""benchkit/phases.py (timing the guard's phases from outside) and overhead.py's breakdown rows."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchkit.phases import GUARD_PHASES, SHARDED_PHASES, PhaseTimer, Target  # noqa: E402


class Work:
    def outer(self) -> int:
        time.sleep(0.01)
        return self.inner() + 1

    def inner(self) -> int:
        time.sleep(0.2)
        return 1

    def absorb(self) -> int:
        time.sleep(0.01)
        return self.inner()


def _targets() -> list[Target]:
    here = __name__
    return [
        Target(f"{here}:Work.outer", "outer"),
        Target(f"{here}:Work.inner", "inner"),
        Target(f"{here}:Work.absorb", "absorb", absorbing=True),
        Target(f"{here}:Work.gone", "gone"),
    ]


def test_nested_calls_are_exclusive_and_absorbed_calls_stay_with_their_parent() -> None:
    """A wrapped call's own time excludes wrapped calls inside it, except under an absorbing one;
    results are unchanged, a missing name is reported, and the originals come back after."""
    original = Work.__dict__["outer"]
    timer = PhaseTimer(_targets())
    with timer.installed():
        assert Work().outer() == 2
        assert Work().absorb() == 1
    assert Work.__dict__["outer"] is original
    assert timer.missing == [f"{__name__}:Work.gone"]
    assert timer.calls == {"outer": 1, "inner": 1, "absorb": 1}
    assert timer.totals["inner"] >= 0.2
    assert 0.01 <= timer.totals["outer"] < 0.15  # the 0.2 s of inner is not in it
    assert timer.totals["absorb"] >= 0.21  # inner's time stays with the absorbing parent


def test_the_guard_phases_exist_in_this_version() -> None:
    """Every phase overhead.py times is found in the guard as it is now (a rename shows here)."""
    timer = PhaseTimer(SHARDED_PHASES)
    with timer.installed():
        pass
    assert timer.missing == [], (
        "a guard phase was renamed: update GUARD_PHASES in benchmarks/benchkit/phases.py"
    )


def test_breakdown_rows_charge_the_split_against_the_plain_pass() -> None:
    """The split row is probe + rest minus the plain forward + backward; the rest is the step's
    extra time not covered by main-thread components."""
    import overhead

    b = {
        "plain_step_s": 1.0,
        "guarded_step_s": 1.5,
        "plain_forward_backward_s": 0.8,
        "components_s": {
            "own probe: split-off forward + backward": 0.15,
            "training passes (rest of the batch)": 0.7,
            "replay of the received probe: forward + backward": 0.2,
            "reduced-gradient digests [other thread]": 0.05,
        },
    }
    rows, rest = overhead._breakdown_rows(b)
    by = {r["component"]: r["ms_per_step"] for r in rows}
    assert by["replay of the received probe: forward + backward"] == pytest.approx(200)
    split = [v for k, v in by.items() if k.startswith("split")]
    assert split == [pytest.approx(50)]
    assert rest == pytest.approx(500 - 200 - 50)


@pytest.mark.timeout(120)
def test_every_guard_phase_is_called_by_a_guarded_ddp_step() -> None:
    """Each phase overhead.py names is on the path a guarded DDP step takes (2 gloo ranks, replay
    and replica checks every step): a target that resolves but is never called would time nothing."""
    import phase_ranks

    from replicheck.harness.launch import node_names, run_local

    calls = run_local(phase_ranks.timed_steps, node_names(2, 1), timeout=90)[0]
    seen = {name.removesuffix(" [other thread]") for name, n in calls.items() if n > 0}
    assert {t.component for t in GUARD_PHASES} <= seen, calls
