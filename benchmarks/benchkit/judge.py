"""What each part of ``gpu_check.py`` must show: named checks, each ``{"ok", "judged", "detail"}``.

A check that is ``judged: False`` records a finding (or says why it could not be judged) and
never fails the part; a judged one fails it when ``ok`` is False.
"""

from __future__ import annotations

from typing import Any

from benchkit.gpu_parts import NOT_ON_CPU, REPRO_REPEATS
from benchkit.settings import CheckSettings

Check = dict[str, Any]


def check(ok: bool, detail: str, *, judged: bool = True) -> Check:
    return {"ok": bool(ok), "judged": judged, "detail": detail}


def _incident_line(inc: dict[str, Any] | None) -> str:
    if inc is None:
        return "no incident"
    return f"incident {inc.get('id')} at step {inc['step']}, check {inc['check']}, {inc['classification']}"


def gib(v: Any) -> str:
    """A memory figure with its unit, or the reason there is none."""
    return f"{v} GiB" if isinstance(v, (int, float)) else str(v)


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else text


def exchange_checks(res: dict[str, Any], st: CheckSettings) -> dict[str, Check]:
    """Part a: every step verified, no incident, no error, over the expected backend."""
    want = list(range(st.loop_steps))
    if res["error"]:
        loop = check(False, _last_line(res["error"]))
    else:
        loop = check(
            res["incident"] is None and res["verified"] == want,
            f"verified steps {res['verified']} (expected {want}); {_incident_line(res['incident'])}; "
            f"communication device {res['comm_device']}",
        )
    pairs = res.get("pairs")
    distances = "not observable" if pairs is None else str([p["max_distance"] for p in pairs])
    return {
        "guarded_loop_verifies_every_step": loop,
        "backend": check(res["backend"] == st.backend, f"backend {res['backend']} (expected {st.backend})"),
        "pair_distances": check(True, f"largest pair distance per verification: {distances}", judged=False),
    }


def replicated_check(res: dict[str, Any], st: CheckSettings) -> Check:
    """Part b, one kind: refused with a typed error, or an incident at the NaN's step."""
    outcome = res["outcome"]
    if outcome == "refused":
        return check(bool(res["refusal"]), f"refused at construction: {res['refusal']}")
    if outcome == "incident":
        inc = res["incident"]
        return check(
            inc["step"] == st.nan_step,
            f"NaN from step {st.nan_step}: {_incident_line(inc)}",
        )
    if outcome == "error":
        return check(False, _last_line(res["error"]))
    finite = res.get("params_finite_after")
    silent = "SILENT non-finite update" if finite is False else "no incident"
    return check(False, f"NaN from step {st.nan_step}: {silent} (weights finite after: {finite})")


def offload_checks(res: dict[str, Any]) -> dict[str, Check]:
    """Part b, CPU offload: a clean exact verification passes and probe passes see the batch on
    the compute device."""
    if res["outcome"] == NOT_ON_CPU:
        return {"clean_exact_verification": check(True, NOT_ON_CPU, judged=False)}
    if res["outcome"] == "refused":
        why = f"not judged: single-GPU FSDP2 refused at construction: {res['refusal']}"
        return {"clean_exact_verification": check(True, why, judged=False)}
    if res["outcome"] == "error":
        return {"clean_exact_verification": check(False, _last_line(res["error"]))}
    by_pass = res["batch_devices_by_pass"]
    compute = res["compute_device"].split(":")[0]
    probe_devices = sorted({d for p in ("probe", "replay") for d in by_pass.get(p, [])})
    return {
        "clean_exact_verification": check(
            res["outcome"] == "clean" and bool(res["verified"]),
            f"verified steps {res['verified']}; {_incident_line(res['incident'])}",
        ),
        "probe_batch_on_compute_device": check(
            bool(probe_devices) and all(d.split(":")[0] == compute for d in probe_devices),
            f"probe/replay batch devices {probe_devices or 'none seen'}; compute device {res['compute_device']}",
        ),
    }


REPRO_JUDGED = ("sdpa_math_backward", "embedding_backward_3072_indices", "embedding_backward_8192_indices")
"""Operations the exact probe relies on today (math attention pinned; embeddings in every decoder)."""


def reproducibility_checks(
    first: dict[str, Any], second: dict[str, Any]
) -> tuple[dict[str, Check], dict[str, Any]]:
    """Part c: per operation, reproducible over the repeats and across the two processes."""
    checks: dict[str, Check] = {}
    table: dict[str, Any] = {}
    for name, a in first.items():
        b = second.get(name, {})
        if a.get("digests") is None:
            err = a.get("error") or "no result"
            judged = name in REPRO_JUDGED and err != NOT_ON_CPU
            table[name] = {"in_process": None, "across_processes": None, "note": err}
            checks[name] = check(not judged, f"not measured: {err}", judged=judged)
            continue
        in_proc = len(set(a["digests"])) == 1 and len(a["digests"]) == REPRO_REPEATS
        across = b.get("digests") is not None and a["digests"] == b["digests"]
        row: dict[str, Any] = {"in_process": in_proc, "across_processes": across, "digest": a["digests"][0]}
        detail = f"{REPRO_REPEATS} repeats {'identical' if in_proc else 'DIFFER'}; across processes {'identical' if across else 'DIFFER'}"
        if "view_equals_clone" in a:
            same = all(a["view_equals_clone"]) and all(b.get("view_equals_clone", [False]))
            row["view_equals_clone"] = same
            row["max_abs_difference"] = a["max_abs_difference"]
            detail += f"; aligned view vs clone {'bitwise equal' if same else 'DIFFER by ' + str(a['max_abs_difference'])}"
        table[name] = row
        judged = name in REPRO_JUDGED
        checks[name] = check(
            in_proc and across if judged else True, ("" if judged else "finding: ") + detail, judged=judged
        )
    return checks, table


def probe_checks(res: dict[str, Any]) -> dict[str, Check]:
    """Part d: the option exists and every row measured without an incident."""
    if not res["probe_attention_option"]:
        return {
            "probe_attention_option": check(
                False,
                "GuardConfig has no probe_attention: this replicheck pins exact probes to math "
                "attention with no way to compare (the option of issue 23, finding 4)",
            )
        }
    out = {"probe_attention_option": check(True, "GuardConfig.probe_attention present")}
    for row in res["rows"]:
        key = f"{row['tokens']}_tokens_{row['probe_attention']}"
        if row.get("error"):
            out[key] = check(False, row["error"])
        elif row.get("incident"):
            out[key] = check(False, f"false alarm in exact mode: {_incident_line(row['incident'])}")
        else:
            v, o = row["verification_step"], row["ordinary_step"]
            out[key] = check(
                v["verified"] and not o["verified"],
                f"verification step {v['ms']} ms, peak {gib(v['peak_GiB'])}; ordinary step {o['ms']} ms, "
                f"peak {gib(o['peak_GiB'])}",
            )
    return out


def fingerprint_checks(res: dict[str, Any]) -> dict[str, Check]:
    """Part e: the update replay's verification step ran clean (or was refused, with the reason)."""
    rep = res["update_replay"]
    if "refused" in rep:
        return {"update_replay": check(True, f"not judged: {rep['refused']}", judged=False)}
    if "error" in rep:
        return {"update_replay": check(False, rep["error"])}
    if rep.get("incident"):
        return {"update_replay": check(False, f"false alarm: {_incident_line(rep['incident'])}")}
    v = rep["verification_step"]
    return {
        "update_replay": check(
            bool(v["verified"]),
            f"verification step: {v['host_bytes']} bytes to the host in {v['host_copies']} copies, "
            f"peak {gib(v['peak_GiB'])}; devices by pass {v['devices_by_pass']}",
        )
    }


def overhead_checks(res: dict[str, Any]) -> dict[str, Check]:
    """Part f: no false alarm in the exact loops; the tolerant run's distances under its threshold."""
    out = {
        "exact_loops_no_false_alarm": check(
            res["incident"] is None and bool(res["rounds"]),
            f"{len(res['rounds'])} rounds; {_incident_line(res['incident'])}; "
            f"guarded/plain {res.get('ratio_of_totals')}",
        )
    }
    tol = res["tolerant_bf16"]
    if tol["incident"] is not None:
        out["tolerant_distance_under_threshold"] = check(
            False, f"false alarm: {_incident_line(tol['incident'])}"
        )
    elif tol["pairs"] is None:
        out["tolerant_distance_under_threshold"] = check(
            True, "not judged: the judge's distances are not observable in this replicheck", judged=False
        )
    else:
        d, t = tol.get("largest_distance_after_calibration"), tol.get("threshold")
        out["tolerant_distance_under_threshold"] = check(
            d is not None and t is not None and d <= t,
            f"largest distance after calibration {d}, threshold {t}",
        )
    return out
