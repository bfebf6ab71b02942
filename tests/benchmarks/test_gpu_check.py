"""benchmarks/gpu_check.py --tiny: the GPU check's code on the CPU, so the script cannot rot; and
its judges on hand-made results (what a GPU run would fail on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchkit import judge  # noqa: E402
from benchkit.report import FORMAT, FORMAT_DOC, PARTS  # noqa: E402
from benchkit.settings import tiny_settings  # noqa: E402


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    return _run("--tiny", "--out", str(out), timeout=170), out


@pytest.mark.timeout(200)
def test_tiny_run_runs_every_part_and_writes_the_documented_format(
    tiny: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """--tiny runs every part on the CPU without a crash or a skip, and gpu.json / gpu.md have the
    fields and sections docs/results/gpu.md documents; CUDA-only figures say "not run on CPU"."""
    proc, out = tiny
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu.json").read_text())
    assert data["format"] == FORMAT == "replicheck.gpu_check/2"
    assert data["mode"] == "tiny" and tuple(data["parts"]) == PARTS
    for name, part in data["parts"].items():
        assert set(part) == {"status", "seconds", "error", "checks", "result"}, name
        assert part["status"] != "skipped" and part["error"] is None, (name, part["error"])
        for c in part["checks"].values():
            assert set(c) == {"ok", "judged", "detail"}
    env = data["environment"]
    assert env["nccl"] == "not run on CPU" and env["sdpa"] == "not run on CPU" and env["torch"]
    # The code that can run on the CPU did: guarded loops verifying every step, digests compared.
    for mode in ("exchange_exact", "exchange_tolerant"):
        assert data["parts"][mode]["result"]["verified"] == [0, 1, 2]
    ops = data["parts"]["reproducibility"]["result"]["operations"]
    assert ops["sdpa_math_backward"]["across_processes"] is True
    assert ops["sdpa_flash_backward"]["note"] == "not run on CPU"
    fps = data["parts"]["gradient_fingerprints"]["result"]
    assert (
        fps["float32"]["digests"]["host_ms"] > 0
        and fps["bfloat16"]["digests"]["device_ms"] == "not run on CPU"
    )
    over = data["parts"]["overhead"]["result"]
    assert len(over["rounds"]) == 1 and over["ratio_of_totals"] > 0
    assert set(data["parts"]["replicated_nan"]["checks"]) == {"replicate", "hsdp_n_by_1", "fsdp_one_gpu"}
    md = (out / "gpu.md").read_text()
    for heading in ("# GPU check", *[f"## {p}" for p in PARTS], "## Output format"):
        assert heading in md
    assert (proc.returncode == 0) == data["ok"]


@pytest.mark.timeout(200)
def test_tiny_run_passes_every_judged_check(tiny: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """Every judged check passes on the CPU: replicated training with a NaN is refused or caught
    at its step (finding 5), and GuardConfig.probe_attention exists (finding 4)."""
    proc, out = tiny
    data = json.loads((out / "gpu.json").read_text())
    failed = {
        (p, c): v["detail"]
        for p, part in data["parts"].items()
        for c, v in part["checks"].items()
        if v["judged"] and not v["ok"]
    }
    assert not failed
    assert proc.returncode == 0 and "Overall: **passed**" in (out / "gpu.md").read_text()


@pytest.mark.timeout(60)
def test_a_short_budget_skips_the_parts_and_still_writes_the_report(tmp_path: Path) -> None:
    """With less budget than a part needs, every part is reported as skipped (not run), the report
    is written anyway and the exit status is 1."""
    proc = _run("--tiny", "--out", str(tmp_path), "--budget-s", "5", timeout=50)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["ok"] is False and tuple(data["parts"]) == PARTS
    assert all(p["status"] == "skipped" and p["error"].startswith("skipped:") for p in data["parts"].values())
    assert "skipped" in (tmp_path / "gpu.md").read_text()


@pytest.mark.timeout(60)
def test_tiny_without_out_is_refused_before_anything_runs() -> None:
    """--tiny without --out exits 2 with a message instead of overwriting docs/results."""
    proc = _run("--tiny", timeout=50)
    assert proc.returncode == 2 and "--tiny needs --out" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without CUDA")
def test_full_run_without_cuda_is_refused(tmp_path: Path) -> None:
    """Without --tiny on a machine with no CUDA device the script exits 2 and says to use --tiny."""
    proc = _run("--out", str(tmp_path), timeout=50)
    assert proc.returncode == 2 and "use --tiny" in proc.stderr
    assert not (tmp_path / "gpu.json").exists()


def test_the_committed_gpu_page_documents_the_format_and_says_what_ran() -> None:
    """docs/results/gpu.md holds the script's format section word for word and says plainly
    whether it has run on a GPU."""
    page = (ROOT / "docs" / "results" / "gpu.md").read_text(encoding="utf-8")
    assert FORMAT_DOC in page
    assert "Not yet run on a GPU" in page or "Made with `python benchmarks/gpu_check.py` on" in page


def _nan_result(outcome: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "replicate", "outcome": outcome, "refusal": None, "incident": None, "error": None, **kw}


def test_a_silent_non_finite_update_fails_the_replicated_check() -> None:
    """Part b: no incident after a NaN gradient fails (naming the non-finite weights); a typed
    refusal or an incident at the NaN's step passes; an incident at a later step fails."""
    st = tiny_settings()
    silent = judge.replicated_check(_nan_result("no incident", params_finite_after=False), st)
    assert not silent["ok"] and "SILENT" in silent["detail"]
    refused = judge.replicated_check(_nan_result("refused", refusal="GuardConfigError: use DDP"), st)
    assert refused["ok"] and "use DDP" in refused["detail"]
    inc = {"id": "x", "step": st.nan_step, "check": "health", "classification": "nonfinite"}
    assert judge.replicated_check(_nan_result("incident", incident=inc), st)["ok"]
    late = dict(inc, step=st.nan_step + 1)
    assert not judge.replicated_check(_nan_result("incident", incident=late), st)["ok"]


def test_a_probe_batch_on_the_host_fails_the_offload_check() -> None:
    """Part b, CPU offload: a probe pass that saw its batch on the host while the model computes
    on cuda:0 fails (finding 8), even when the verification itself passed."""
    res = {
        "outcome": "clean",
        "verified": [0, 1],
        "incident": None,
        "refusal": None,
        "error": None,
        "compute_device": "cuda:0",
        "batch_devices_by_pass": {"train": ["cuda:0"], "probe": ["cpu"], "replay": ["cuda:0"]},
    }
    checks = judge.offload_checks(res)
    assert checks["clean_exact_verification"]["ok"]
    assert not checks["probe_batch_on_compute_device"]["ok"]
    res["batch_devices_by_pass"]["probe"] = ["cuda:0"]
    assert judge.offload_checks(res)["probe_batch_on_compute_device"]["ok"]


def test_reproducibility_judges_only_what_the_guard_relies_on() -> None:
    """Part c: flash digests that differ are recorded as a finding (the part passes); math
    attention digests that differ across processes fail it."""
    a = {
        "sdpa_math_backward": {"digests": ["1", "1", "1"]},
        "sdpa_flash_backward": {"digests": ["1", "2", "1"]},
    }
    b = {
        "sdpa_math_backward": {"digests": ["2", "2", "2"]},
        "sdpa_flash_backward": {"digests": ["1", "1", "1"]},
    }
    checks, table = judge.reproducibility_checks(a, b)
    assert not checks["sdpa_math_backward"]["ok"] and checks["sdpa_math_backward"]["judged"]
    assert checks["sdpa_flash_backward"]["ok"] and not checks["sdpa_flash_backward"]["judged"]
    assert table["sdpa_flash_backward"]["in_process"] is False
    assert table["sdpa_math_backward"] == {"in_process": True, "across_processes": False, "digest": "1"}


def test_exchange_part_fails_when_a_verification_is_missing() -> None:
    """Part a: a loop that raised (the cross-device compare of finding 1) or skipped a
    verification fails."""
    st = tiny_settings()
    base = {"backend": "gloo", "comm_device": "cpu", "incident": None, "pairs": None}
    raised = dict(
        base, error="Traceback...\nRuntimeError: Expected all tensors to be on the same device", verified=[]
    )
    assert not judge.exchange_checks(raised, st)["guarded_loop_verifies_every_step"]["ok"]
    short = dict(base, error=None, verified=[0, 1])
    assert not judge.exchange_checks(short, st)["guarded_loop_verifies_every_step"]["ok"]
    full = dict(base, error=None, verified=[0, 1, 2])
    assert judge.exchange_checks(full, st)["guarded_loop_verifies_every_step"]["ok"]
