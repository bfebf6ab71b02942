"""An error in a failure-path re-run (an arbiter's replay, a suspect's re-run, a gradient re-run
on the suspect or on its peer) ends every rank promptly and the incident is still recorded.

Out of memory is the likely error there (a re-run holds another gradient set); it is injected as
``torch.OutOfMemoryError`` or a plain ``RuntimeError`` on one rank. The process group's timeout is
short (15 s), so a rank left waiting in a collective fails the test quickly."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import CorruptionDetected, Guard, GuardConfig, PeerFailed, current_pass, current_step
from replicheck.harness.launch import RankContext, node_names, run_local

GROUP_TIMEOUT = 15.0

# where: (failing rank, the step, which of that rank's replay passes of the step raises)
# arbitration: rank 1 replays its source's probe wrong from step 2, so its lone failing pair is
#   arbitrated by the third rank (rank 2: rank 1 verifies rank 0), whose replay raises;
# rerun: the same, arbitration names rank 1, and rank 1's re-run of its replay raises;
# suspect / peer: rank 1's gradient is NaN at step 1 (no verification there); the re-run of its
#   passes on rank 1 (suspect) or on its peer, rank 2, raises.
CASES: dict[str, tuple[int, int, int]] = {
    "arbitration": (2, 2, 2),
    "rerun": (1, 2, 2),
    "suspect": (1, 1, 1),
    "peer": (2, 1, 1),
}


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step * 100 + rank))
    return {"x": x, "y": x.sum(-1)}


def _job(ctx: RankContext, where: str, error: str, incident_dir: str) -> dict[str, Any]:
    failing, at, nth = CASES[where]
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    replays: list[int] = []

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()
        if current_pass() == "replay" and current_step() == at:
            replays.append(at)
            if ctx.rank == failing and len(replays) == nth:
                if error == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory (injected into a re-run)")
                raise RuntimeError("a re-run broke (injected)")
        if (
            where in ("suspect", "peer")
            and ctx.rank == 1
            and current_step() == 1
            and current_pass() == "train"
        ):
            return loss * float("nan")
        return loss

    if where in ("arbitration", "rerun") and ctx.rank == 1:

        def fault(mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
            return out + 1.0 if current_step() >= 2 and current_pass() == "replay" else None

        model.module[0].register_forward_hook(fault)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = GuardConfig(verify_every=2, probe="extra", incident_dir=incident_dir)
    guard = Guard(model, opt, loss_fn, config=cfg, node=ctx.node)
    t0 = time.monotonic()
    out: dict[str, Any] = {"outcome": "finished", "incident": None, "notes": []}
    try:
        for s in range(4):
            guard.step(_batch(s, ctx.rank))
    except PeerFailed as exc:
        out.update(
            outcome="PeerFailed", ranks=exc.ranks, incident=getattr(exc, "incident", None) and exc.incident.id
        )
    except CorruptionDetected as exc:
        out.update(outcome="CorruptionDetected", incident=exc.incident.id)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        out.update(outcome=type(exc).__name__, notes=list(getattr(exc, "__notes__", [])), text=str(exc)[:200])
    out.update(seconds=time.monotonic() - t0, step=guard.next_step)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "error"),
    [("arbitration", "oom"), ("rerun", "runtime"), ("suspect", "oom"), ("peer", "runtime")],
)
def test_an_error_in_a_failure_path_rerun_ends_every_rank_and_keeps_the_incident(
    where: str, error: str, tmp_path: Path
) -> None:
    """The rank whose re-run raised re-raises its own error (noting the incident), the others
    raise PeerFailed naming it and holding the incident, all in the same step and well under the
    process group's timeout; the incident file holds what was known, marked as a failed re-run,
    and blames no rank the evidence does not name."""
    failing, at, _ = CASES[where]
    results = run_local(
        _job, node_names(3, 1), args=(where, error, str(tmp_path)), timeout=60, group_timeout=GROUP_TIMEOUT
    )
    expected = "OutOfMemoryError" if error == "oom" else "RuntimeError"
    for rank, r in enumerate(results):
        assert r["seconds"] < GROUP_TIMEOUT, (rank, r)
        assert r["step"] == at, (rank, r)
        if rank == failing:
            assert r["outcome"] == expected, (rank, r)
            assert any("incident" in n for n in r["notes"]), r
        else:
            assert (r["outcome"], r.get("ranks")) == ("PeerFailed", (failing,)), (rank, r)
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    inc = json.loads(files[0].read_text())
    assert inc["step"] == at
    assert {r["incident"] for r in results if r["outcome"] == "PeerFailed"} == {inc["id"]}
    check = "replay" if where in ("arbitration", "rerun") else "gradients"
    assert inc["check"] == check
    failed = inc["evidence"][check]["rerun_failed"]
    assert failed["ranks"] == [failing] and expected in failed["errors"][str(failing)], failed
    assert inc["classification"] == "ambiguous"
    if where == "rerun":
        # Arbitration named rank 1 before its re-run broke: the evidence names it, unclassified.
        assert inc["suspect_ranks"] == [1]
    else:
        # An unfinished arbitration or gradient re-run names nobody: rank 1 is a candidate.
        assert inc["suspect_ranks"] == []
        assert 1 in [c["rank"] for c in inc["candidates"]]
