"""benchmarks/gpu_check.py --tiny: the GPU check's code paths on the CPU, so the script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = ("guard_multiprocess", "nccl_smoke", "fingerprint_throughput", "step_ratio")


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


@pytest.mark.timeout(280)
def test_tiny_run_passes_every_part_and_writes_the_documented_format(tmp_path: Path) -> None:
    """--tiny runs all four parts on the CPU, every check passes, and gpu.json / gpu.md have the
    fields and sections docs/results/gpu.md documents."""
    proc = _run("--tiny", "--out", str(tmp_path), timeout=260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["format"] == "replicheck.gpu_check/1"
    assert data["mode"] == "tiny" and data["ok"] is True
    assert {"torch", "cuda", "device", "python", "CUBLAS_WORKSPACE_CONFIG"} <= set(data["environment"])
    assert tuple(data["parts"]) == PARTS
    for name, part in data["parts"].items():
        assert set(part) == {"ok", "seconds", "error", "checks", "result"}, name
        assert part["ok"] is True and part["error"] is None, (name, part["error"])
    guard = data["parts"]["guard_multiprocess"]["checks"]
    assert set(guard) == {
        "clean_exact_verifications_pass",
        "forward_fault_caught",
        "backward_fault_caught",
        "resume_bit_identical",
    }
    assert all(c["ok"] for c in guard.values())
    assert set(data["parts"]["nccl_smoke"]["checks"]) == {"guarded_loop_runs", "backend"}
    tp = data["parts"]["fingerprint_throughput"]["result"]
    assert set(tp["ops"]) == {"copy_", "clone", "digest", "digest_fold_zero", "sketch_k4"}
    assert tp["copy_bandwidth_GBps"] > 0 and tp["tensor"]["bytes"] == 8 * 2**20
    for op, v in tp["ops"].items():
        assert v["ms"] > 0 and v["tensor_GBps"] > 0
        frac = v["fraction_of_copy_bandwidth"]
        assert frac is None if op in ("copy_", "clone") else frac > 0
    assert isinstance(tp["digest_meets_goal"], bool) and isinstance(tp["sketch_meets_goal"], bool)
    ratio = data["parts"]["step_ratio"]["result"]
    assert ratio["rounds"] == 2 and ratio["steps_per_round"] == 10 and ratio["ratio_of_totals"] > 0
    # No device: the sync counts are reported as unknown, not as zero.
    assert set(data["syncs_per_step"]) == {
        "guard_3_ranks_gloo_rank0",
        "smoke_world_size_1",
        "step_ratio_large_model_world_size_1",
    }
    for run in data["syncs_per_step"].values():
        assert run["ordinary"] is None and run["verification"] is None
        assert run["ordinary_per_step"] and all(v is None for v in run["ordinary_per_step"])
    md = (tmp_path / "gpu.md").read_text()
    for heading in ("# GPU check", *[f"## {p}" for p in PARTS], "## Output format"):
        assert heading in md
    assert "Overall: **passed**" in md


@pytest.mark.timeout(120)
def test_a_spent_budget_fails_the_parts_left_and_still_writes_the_report(tmp_path: Path) -> None:
    """With an overall budget that one part uses up, the parts after it are reported as not run,
    the report is written anyway and the exit status is 1."""
    proc = _run("--tiny", "--out", str(tmp_path), "--budget-s", "25", timeout=100)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["ok"] is False and tuple(data["parts"]) == PARTS
    last = data["parts"]["step_ratio"]
    assert last["ok"] is False and last["error"].startswith("not run:")
    assert "FAILED" in (tmp_path / "gpu.md").read_text()


@pytest.mark.timeout(60)
def test_tiny_without_out_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """--tiny without --out exits 2 with a message instead of overwriting docs/results."""
    proc = _run("--tiny", timeout=50)
    assert proc.returncode == 2
    assert "--tiny needs --out" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_full_run_without_cuda_is_refused(tmp_path: Path) -> None:
    """Without --tiny on a machine with no CUDA device the script exits 2 and says to use --tiny."""
    proc = _run("--out", str(tmp_path), timeout=50)
    assert proc.returncode == 2
    assert "use --tiny" in proc.stderr
    assert not (tmp_path / "gpu.json").exists()


def test_the_committed_gpu_page_documents_the_format_the_script_writes() -> None:
    """docs/results/gpu.md holds the script's format section word for word (a template until a
    GPU run replaces it, and the same section after)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchkit.report import FORMAT_DOC

    assert FORMAT_DOC in (ROOT / "docs" / "results" / "gpu.md").read_text(encoding="utf-8")
