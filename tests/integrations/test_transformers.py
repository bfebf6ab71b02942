"""GuardedTrainer (replicheck.integrations.transformers) against the real Hugging Face Trainer: the
same training as the stock Trainer, a fault caught and the job ended with exit 87 under torchrun,
the guard's state carried by the Trainer's checkpoints, and what it cannot guard refused.

A tiny LlamaForCausalLM built from a config (nothing downloaded), a token dataset whose label
counts differ per sample, micro-batch and rank; gloo ranks on CPU."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Read by huggingface_hub when transformers is first imported, here or in a rank.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_trainer_ranks as ranks  # noqa: E402

from replicheck.harness.launch import node_names, run_local  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank launch: stock vs guarded Trainer, then a checkpointed run and its resume."""
    workdir = tmp_path_factory.mktemp("hf")
    return run_local(ranks.run_pair_and_resume, node_names(2, 1), args=(str(workdir),), timeout=240)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())


@pytest.mark.timeout(300)
def test_guarded_trainer_trains_as_the_stock_trainer(pair: list[dict[str, Any]]) -> None:
    """2 DDP ranks, gradient accumulation 2, token counts averaged across ranks, clipping that
    bites on every step, a linear schedule: the GuardedTrainer ends on the stock Trainer's
    weights, logs its loss and pre-clip grad_norm on every step, and its step count; the guard
    steps with the Trainer and verified its last scheduled step."""
    for r in pair:
        stock, guarded = r["stock"], r["guarded"]
        assert stock["global_step"] == guarded["global_step"] == 6
        assert _rel(stock["weights"], guarded["weights"]) <= 1e-6
        assert len(stock["log"]) == len(guarded["log"]) == 6
        for s, g in zip(stock["log"], guarded["log"], strict=True):
            assert s["step"] == g["step"]
            assert s["grad_norm"] > 0.5  # clipping (max_grad_norm=0.5) acted on this step
            assert abs(s["grad_norm"] - g["grad_norm"]) <= 1e-4 * s["grad_norm"]
            assert abs(s["loss"] - g["loss"]) <= 1e-6 * s["loss"]
            assert s["learning_rate"] == g["learning_rate"]
        assert guarded["next_step"] == [1, 2, 3, 4, 5, 6]
        assert guarded["last_verified"] == 4
        assert guarded["optimizer_restored"] == "AcceleratedOptimizer"
        assert not [w for w in guarded["warnings"] if "replicheck" in w or "lr_scheduler" in w]
    assert torch.equal(pair[0]["guarded"]["weights"], pair[1]["guarded"]["weights"])


@pytest.mark.timeout(300)
def test_compute_loss_override_weighted_as_the_stock_trainer(pair: list[dict[str, Any]]) -> None:
    """A Trainer subclass whose compute_loss returns a per-micro-batch mean
    (``loss_is_scaled_for_ga = False``): the guard weights the equal micro-batches by their
    sample share, which is the stock Trainer's division by the accumulation steps."""
    for r in pair:
        mean = r["mean"]
        assert mean["reduction"] == "unknown"
        assert _rel(mean["stock"], mean["guarded"]) <= 1e-6
        assert len(mean["stock_log"]) == len(mean["guarded_log"]) == 4
        for s, g in zip(mean["stock_log"], mean["guarded_log"], strict=True):
            assert abs(s["grad_norm"] - g["grad_norm"]) <= 1e-4 * s["grad_norm"]
            assert abs(s["loss"] - g["loss"]) <= 1e-6 * s["loss"]


@pytest.mark.timeout(300)
def test_resume_from_a_trainer_checkpoint_continues_the_guard(pair: list[dict[str, Any]]) -> None:
    """The Trainer's checkpoint-2 holds the guard's state; a fresh GuardedTrainer resumed from it
    restores that state (no fresh-start warning), its guard steps on from step 2, and it ends on
    the uninterrupted guarded run's weights bit for bit."""
    for r in pair:
        res = r["resume"]
        assert "replicheck_guard_state.json" in res["files"]
        assert res["saved_state"]["next_step"] == 2
        assert res["saved_state"]["last_verified_step"] == 0
        assert res["next_step"] == [3, 4]
        assert not [w for w in res["warnings"] if "replicheck" in w]
        assert torch.equal(res["whole"], res["resumed"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(150)
def test_fault_under_torchrun_exits_87_naming_the_node(tmp_path: Path) -> None:
    """torchrun, 3 ranks (with 2 a persistent fault is ambiguous by design: each rank's replay of
    the other disagrees): rank 1's forward is corrupted from step 3; the verification at step 4
    catches it, the workers exit 87 with the incident in their torchrun error files, and the
    incident written names rank 1 on node1."""
    incidents, logs = tmp_path / "incidents", tmp_path / "logs"
    incidents.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "3",
        "--master-port",
        str(_free_port()),
        "--log-dir",
        str(logs),
        str(HERE / "hf_torchrun_job.py"),
        str(incidents),
        str(tmp_path / "out"),
        "3",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    # torchrun itself exits 1 when a worker fails; each worker's own code is in its summary.
    # The first worker to exit is the root cause (87); torchrun then stops the others, which
    # exit 87 too or, still tearing down, by its SIGTERM.
    assert proc.returncode == 1, proc.stderr[-3000:]
    root = proc.stderr.split("Root Cause")[-1]
    assert re.search(r"exitcode\s*:\s*87\b", root), proc.stderr[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)) <= {"87", "-15"}
    errors = sorted(logs.rglob("error.json"))
    assert errors
    for path in errors:
        recorded = json.loads(path.read_text())["message"]["extraInfo"]["replicheck_incident"]
        assert recorded["step"] == 4
        assert [(s["rank"], s["node"]["name"]) for s in recorded["suspects"]] == [(1, "node1")]
    from replicheck.incident import read_incident

    (written,) = sorted(incidents.glob("*.json"))
    incident = read_incident(written)
    assert incident.step == 4
    assert [(s.rank, s.node.name) for s in incident.suspects] == [(1, "node1")]


def _single(tmp_path: Path, **overrides: Any) -> Any:
    """Training arguments for one process (no process group)."""
    return ranks.training_args(str(tmp_path), ddp_backend=None, **overrides)


@pytest.mark.timeout(120)
def test_unsupported_setups_refused_before_training(tmp_path: Path) -> None:
    """fp16 (the Trainer's GradScaler), label smoothing, a compute_loss_func and a guard
    max_grad_norm that disagrees with the Trainer's are each a GuardConfigError at construction,
    saying what to do."""
    from replicheck.guard import GuardConfig, GuardConfigError
    from replicheck.integrations.transformers import GuardedTrainer

    data = ranks.TokenData(8)
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"fp16": True}, {}, "use bf16=True"),
        ({"label_smoothing_factor": 0.1}, {}, "label_smoothing_factor"),
        ({}, {"compute_loss_func": lambda *a, **k: None}, "compute_loss_func"),
        ({}, {"guard_config": GuardConfig(max_grad_norm=1.0)}, "set the clipping once"),
    ]
    for overrides, kwargs, said in cases:
        with pytest.raises(GuardConfigError, match=said):
            GuardedTrainer(
                model=ranks.tiny_llama(), args=_single(tmp_path, **overrides), train_dataset=data, **kwargs
            )


@pytest.mark.timeout(120)
def test_optimizer_step_outside_the_guard_refused(tmp_path: Path) -> None:
    """During training the Trainer's optimizer is the guard's stand-in: a callback's own
    ``optimizer.step()`` raises GuardMisuseError instead of applying an unchecked update, and
    the stand-in is gone once train() ends."""
    from transformers import TrainerCallback

    from replicheck.guard import GuardMisuseError
    from replicheck.integrations.transformers import GuardedTrainer

    class StepsItself(TrainerCallback):
        def on_step_begin(
            self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any
        ) -> None:
            if state.global_step == 1:
                optimizer.step()

    trainer = GuardedTrainer(
        model=ranks.tiny_llama(),
        args=_single(tmp_path, max_steps=2, gradient_accumulation_steps=1),
        train_dataset=ranks.TokenData(8),
        callbacks=[StepsItself()],
    )
    with (
        pytest.warns(UserWarning, match="world size 1"),
        pytest.raises(GuardMisuseError, match="optimizer.step"),
    ):
        trainer.train()
    assert trainer.guard is not None and trainer.guard.next_step == 1
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"


@pytest.mark.timeout(60)
def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without transformers installed, importing the integration is an ImportError naming the
    extra that installs it."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package imports as
    monkeypatch.delitem(sys.modules, "replicheck.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"replicheck\[transformers\]"):
        importlib.import_module("replicheck.integrations.transformers")
