"""The campaign runner on a tiny job: a fast subset of the matrix, its table and its files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from replicheck.campaign.report import markdown
from replicheck.campaign.runner import controller_actions, run_campaign
from replicheck.campaign.scenarios import (
    JobDefaults,
    default_scenarios,
    fast_scenarios,
    select,
)
from replicheck.campaign.soak import (
    NOISE_SHAPES,
    SoakConfig,
    SoakResult,
    bf16_soak,
    parse_noise,
    soak_markdown,
    soak_model,
)
from replicheck.faults.errors import FaultConfigError
from replicheck.faults.noise import KernelNoise, RankBias


def _tiny(**kw: object) -> JobDefaults:
    return JobDefaults(model=soak_model(), batch=2, steps=31, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_fast_subset_detects_at_the_first_check_with_the_right_suspect() -> None:
    """Each fast-subset row behaves as documented: detected on time with the right suspect, the
    unverified one-shot fault missed, the clean run silent — and no false alarms anywhere."""
    outcomes = run_campaign(fast_scenarios(), _tiny())
    by = {o.name: o for o in outcomes}
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert all(o.as_expected for o in outcomes), {o.name: o.to_dict() for o in outcomes if not o.as_expected}
    aws = by["aws-persistent-3n"]
    assert (aws.detected_at, aws.suspect_ranks, aws.applied_corrupted, aws.classification) == (
        30,
        [1],
        [23, 29],
        "persistent",
    )
    red = by["reduced-gradient"]
    assert (red.detected_at, red.check, red.applied_corrupted) == (23, "reduced_gradients", None)
    assert by["transient-unverified"].detected_at is None and by["transient-unverified"].corruptions == 1
    assert by["clean"].verification_pairs == 4 * 4 and sum(o.false_alarms for o in outcomes) == 0


@pytest.mark.timeout(240)
def test_data_borne_and_refused_rows_hold_what_they_claim() -> None:
    """The data-borne row is caught on its step as ``data`` with no node named and no controller
    action; the refused rows are refused on every rank with the expected message, and a refusal
    that does not say what the row expects is not counted as expected."""
    rows = select(default_scenarios(), "data-borne-inf,syncbn-refused,static-graph-refused")
    wrong = dataclasses.replace(rows[-1], name="static-graph-wrong-text", refusal="no such advice")
    outcomes = {o.name: o for o in run_campaign([*rows, wrong], _tiny())}
    assert all(o.error is None for o in outcomes.values()), [o.error for o in outcomes.values()]
    data = outcomes["data-borne-inf"]
    assert data.as_expected and (data.detected_at, data.check, data.classification) == (
        23,
        "gradients",
        "data",
    )
    assert data.suspect_ranks == [] and data.false_alarms == 0
    assert data.incident is not None and controller_actions(data.incident) == []
    for name, text in (("syncbn-refused", "SyncBatchNorm"), ("static-graph-refused", "static_graph")):
        o = outcomes[name]
        assert o.as_expected and o.check == "refused at construction" and text in (o.refusal or "")
    assert not outcomes["static-graph-wrong-text"].as_expected
    table = markdown([o.to_dict() for o in outcomes.values()], {}, plots=False)
    assert "| refused at construction |" in table and "none named" in table


@pytest.mark.timeout(120)
def test_cli_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    """`replicheck campaign` writes results.json, results.md and one PNG per scenario."""
    from replicheck.cli import main

    pytest.importorskip("matplotlib")
    rc = main(
        [
            "campaign",
            "--scenarios",
            "reduced-gradient",
            "--tiny",
            "--steps",
            "26",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in data["scenarios"]] == ["reduced-gradient"]
    assert "| `reduced-gradient` |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "reduced-gradient.png").stat().st_size > 1000


@pytest.mark.timeout(30)
def test_markdown_without_plots_says_how_to_get_them() -> None:
    """Without matplotlib the table is still written and tells how to get the timelines."""
    row = {
        "name": "clean",
        "title": "Clean run",
        "fault": None,
        "nodes": 2,
        "gpus_per_node": 2,
        "mode": "exact",
        "verify_every": 10,
        "onset": None,
        "detected_at": None,
        "applied_corrupted": None,
        "check": None,
        "suspect_correct": None,
        "classification": None,
        "false_alarms": 0,
        "as_expected": True,
    }
    text = markdown([row], {"command": "replicheck campaign"}, plots=False)
    assert "| `clean` |" in text and "replicheck[plot]" in text and "15,320" in text


@pytest.mark.timeout(30)
def test_scenario_filter_matches_names_and_rejects_unknown() -> None:
    """--scenarios keeps the named rows (prefixes with *) and rejects names it does not know."""
    names = [s.name for s in select(default_scenarios(), "clean*,nan")]
    assert names == ["nan", "clean", "clean-tolerant"]
    with pytest.raises(FaultConfigError):
        select(default_scenarios(), "nope")


@pytest.mark.timeout(30)
def test_bf16_one_percent_rows_exact_catches_tolerant_documents_the_limit() -> None:
    """x1.01 on 8 values of a weight gradient under bf16 has two rows: exact mode (no kernel
    noise) expected caught, tolerant mode expected missed; no bf16 row sets a tolerance, so the
    guard's bf16 defaults are what the table shows."""
    rows = {s.name: s for s in select(default_scenarios(), "bf16-*")}
    exact, tolerant = rows["bf16-wgrad-1pct-exact"], rows["bf16-wgrad-1pct"]
    for row in (exact, tolerant):
        assert row.loss == "lm_bf16" and row.fault is not None
        assert row.fault.what.describe() == "scale 8 value(s) by 1.01"
        assert row.fault.onset == 23
    assert (exact.mode, exact.expect, exact.noise) == ("exact", "detect", ())
    assert (tolerant.mode, tolerant.expect) == ("tolerant", "undetected") and tolerant.noise
    assert "soak-bf16.md" in tolerant.note and "start-up log" in tolerant.note
    for row in rows.values():
        assert (row.tolerance_floor, row.tolerance_ceiling, row.sketch_block) == (None, None, None)


@pytest.mark.timeout(60)
def test_noise_option_refuses_bad_input_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--noise refuses an unknown shape (naming it and the known ones), --noise without --soak,
    and noise on an exact-mode soak: exit code 2, nothing run or written."""
    from replicheck.cli import main

    out = tmp_path / "o"
    base = ["campaign", "--out", str(out), "--no-progress"]
    assert main([*base, "--soak", "8", "--bf16", "--noise", "gaussian,pink"]) == 2
    err = capsys.readouterr().err
    assert "'pink'" in err and "gaussian, additive, ulp, heavy, bias" in err
    assert main([*base, "--noise", "ulp"]) == 2
    assert "--soak only" in capsys.readouterr().err
    assert main([*base, "--soak", "8", "--noise", "gaussian"]) == 2
    assert "tolerant mode" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.timeout(30)
def test_bf16_soak_covers_every_noise_shape_and_has_time_for_100000_pairs() -> None:
    """The bf16 soak's default noise is one model per shape (bias on rank 1 only), its tolerances
    are left to the guard, and its time limit fits 100,000 pairs at 60 ms a pair with room."""
    cfg = bf16_soak(SoakConfig(pairs=100_000))
    shapes = [m.shape if isinstance(m, KernelNoise) else "bias" for m in cfg.noise]
    assert shapes == list(NOISE_SHAPES)
    assert [m.ranks for m in cfg.noise if isinstance(m, RankBias)] == [(1,)]
    assert (cfg.mode, cfg.loss, cfg.tolerance_floor, cfg.tolerance_ceiling, cfg.sketch_block) == (
        "tolerant",
        "lm_bf16",
        None,
        None,
        None,
    )
    assert cfg.time_limit >= 3 * 3600 and cfg.time_limit >= 2 * 0.06 * cfg.pairs
    assert [type(m).__name__ for m in bf16_soak(SoakConfig(), noise=parse_noise("bias")).noise] == [
        "RankBias"
    ]
    assert bf16_soak(SoakConfig(), noise=parse_noise("none")).noise == ()


@pytest.mark.timeout(30)
def test_soak_report_lists_noise_models_tolerances_and_rates() -> None:
    """soak-bf16.md names each noise model, the tolerances the guard reported, and the pairs,
    false alarms, wall time, ms per step and pairs per second."""
    cfg = bf16_soak(SoakConfig(pairs=400))
    chosen = {"precision": "bf16", "sketch_block": 256, "floor": 0.08, "ceiling": 0.2, "threshold": 0.08}
    result = SoakResult(
        steps=100,
        world=4,
        verification_steps=100,
        verification_pairs=400,
        weight_checks=100,
        false_alarms=0,
        seconds=20.0,
        ms_per_step=200.0,
        final_loss=2.0,
        first_loss=5.0,
        incident=None,
        config={
            **dataclasses.asdict(cfg),
            "model": dataclasses.asdict(cfg.model or soak_model()),
            "noise": [{"kind": type(m).__name__, **dataclasses.asdict(m)} for m in cfg.noise],
        },
        pairs_per_second=20.0,
        tolerance=chosen,
        tolerances=[chosen] * 4,
    )
    text = soak_markdown(result, "replicheck campaign --soak 400 --bf16", 2, "2.x")
    for shape in ("gaussian", "additive", "ulp", "heavy"):
        assert f"- {shape}: " in text
    assert "`RankBias`" in text and "rank(s) 1 " in text
    assert "precision bf16, sketch block 256 values, floor 0.08, ceiling 0.2" in text
    assert "None set by the run" in text
    assert "| false alarms | 0 | 0 |" in text and "200.0 ms per step" in text
    assert "| verification pairs per second | 20.0 | – |" in text
