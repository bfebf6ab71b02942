"""What the guard runs and the smoke must show: each check a named boolean with its evidence."""

from __future__ import annotations

from typing import Any

from benchkit.guarded_runs import FAULT_RANK
from benchkit.settings import CheckSettings


def verification_steps(steps: int, every: int) -> list[int]:
    return [s for s in range(steps) if s % every == 0]


def first_check_at_or_after(onset: int, every: int) -> int:
    return -(-onset // every) * every


def _errors(ranks: list[dict[str, Any]]) -> list[str]:
    return [f"rank {r['rank']}: {r['error']}" for r in ranks if r.get("error")]


def _incident_line(inc: dict[str, Any] | None) -> str:
    if inc is None:
        return "no incident"
    return (
        f"incident at step {inc['step']}, check {inc['check']}, {inc['classification']}, "
        f"suspects {inc['suspect_ranks']} on {inc['suspect_nodes']}"
    )


def guard_checks(by_rank: list[dict[str, dict[str, Any]]], st: CheckSettings) -> dict[str, dict[str, Any]]:
    """The four checks of the multi-process part, from every rank's runs."""
    nodes = [r["clean"]["node"] for r in by_rank]
    expected_verified = verification_steps(st.steps, st.verify_every)
    checks: dict[str, dict[str, Any]] = {}

    clean = [r["clean"] for r in by_rank]
    errs = _errors(clean)
    ok = not errs and all(c["incident"] is None and c["verified"] == expected_verified for c in clean)
    checks["clean_exact_verifications_pass"] = {
        "ok": ok,
        "detail": errs[0]
        if errs
        else f"verified steps {clean[0]['verified']} (expected {expected_verified}); "
        + _incident_line(clean[0]["incident"]),
    }

    catch = first_check_at_or_after(st.fault_onset, st.verify_every)
    for name in ("forward_fault", "backward_fault"):
        runs = [r[name] for r in by_rank]
        errs = _errors(runs)
        inc = runs[0]["incident"]
        ok = (
            not errs
            and inc is not None
            and all(r["incident"] is not None and r["incident"]["id"] == inc["id"] for r in runs)
            and inc["step"] == catch
            and inc["check"] == "replay"
            and inc["suspect_ranks"] == [FAULT_RANK]
            and inc["suspect_nodes"] == [nodes[FAULT_RANK]]
        )
        checks[f"{name}_caught"] = {
            "ok": ok,
            "detail": errs[0]
            if errs
            else f"onset {st.fault_onset} on rank {FAULT_RANK} ({nodes[FAULT_RANK]}); expected at step {catch}: "
            + _incident_line(inc),
        }

    resumed = [r["resumed"] for r in by_rank]
    errs = _errors(resumed)
    if errs:
        checks["resume_bit_identical"] = {"ok": False, "detail": errs[0]}
    else:
        same_digest = all(r.get("digest") == c.get("digest") for r, c in zip(resumed, clean))
        same_losses = all(
            all(r["losses"].get(s) == c["losses"].get(s) for s in range(st.save_at + 1, st.steps))
            for r, c in zip(resumed, clean)
        )
        from_ok = all(r.get("resumed_from") == st.save_at for r in resumed)
        checks["resume_bit_identical"] = {
            "ok": from_ok and same_digest and same_losses and all(r["incident"] is None for r in resumed),
            "detail": f"resumed from step {resumed[0].get('resumed_from')} (saved at {st.save_at}); final "
            f"weights {'identical' if same_digest else 'DIFFER'}; losses of steps {st.save_at + 1}-"
            f"{st.steps - 1} {'identical' if same_losses else 'DIFFER'}; "
            + _incident_line(resumed[0]["incident"]),
        }
    return checks


def smoke_checks(out: dict[str, Any], backend: str) -> dict[str, dict[str, Any]]:
    ok = out["error"] is None and out["incident"] is None and out["verified"] == [0, 3]
    detail = out["error"] or f"verified steps {out['verified']} (expected [0, 3]); " + _incident_line(
        out["incident"]
    )
    return {
        "guarded_loop_runs": {"ok": ok, "detail": detail},
        "backend": {"ok": out.get("backend") == backend, "detail": f"backend {out.get('backend')}"},
    }
