"""Lightning's automatic optimisation under the guard (``GuardedDDPStrategy``): the same weights,
steps, logged metrics and clipping as stock Lightning DDP, the guard's state in Lightning's
checkpoints, a forward fault caught and turned into exit 87, and what cannot run exactly refused
before training. Real Lightning on gloo ranks (CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from replicheck.codes import EXIT_CORRUPTION  # noqa: E402
from replicheck.elastic import guarded_main  # noqa: E402
from replicheck.faults import Fault  # noqa: E402
from replicheck.guard import GuardConfig, GuardConfigError  # noqa: E402
from replicheck.harness.launch import RankContext, node_names, run_local  # noqa: E402
from replicheck.integrations.lightning import CHECKPOINT_KEY, GuardedDDPStrategy  # noqa: E402

STEPS = 6
CLIP = 0.05  # well under the gradient norms of this model and data: every step is clipped


class _Net(pl.LightningModule):
    """A small MLP with dropout, AdamW and a per-step StepLR; counts its training_step calls and
    its ``self.log`` calls, and records the gradient norm on_before_optimizer_step sees."""

    def __init__(self, *, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
        self.automatic_optimization = not manual
        self.calls = 0
        self.logged: list[float] = []
        self.hook_norms: list[float] = []
        self.after_backward = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        self.calls += 1
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return {"loss": loss}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.logged.append(float(value.detach() if isinstance(value, torch.Tensor) else value))
        super().log(name, value, *args, **kwargs)

    def on_after_backward(self) -> None:
        self.after_backward += 1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.hook_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _model(**kwargs: Any) -> _Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Net(**kwargs)


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g))
    return DataLoader(data, batch_size=4)  # 24 samples per rank: 6 batches


def _trainer(strategy: Any, *, max_steps: int = STEPS, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=kwargs.pop("devices", 2),
        max_steps=max_steps,
        gradient_clip_val=kwargs.pop("gradient_clip_val", CLIP),
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _launched_externally(ctx: RankContext) -> None:
    """The variables torchrun sets: Lightning then joins the existing process group instead of
    launching processes of its own."""
    os.environ.update(
        RANK=str(ctx.rank),
        LOCAL_RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.world_size),
        LOCAL_WORLD_SIZE=str(ctx.world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",  # unused: the process group exists already
        TORCHELASTIC_RUN_ID="lightning-test",
        REPLICHECK_NODE=ctx.node,
    )


def _guarded(**cfg: Any) -> GuardedDDPStrategy:
    return GuardedDDPStrategy(guard_config=GuardConfig(**cfg), process_group_backend="gloo")


def _lightning_job(ctx: RankContext, tmp: str) -> dict[str, Any]:
    """Rank part: stock and guarded Lightning on the same data, then a checkpoint and its resume."""
    torch.set_num_threads(1)
    _launched_externally(ctx)
    out: dict[str, Any] = {}

    runs = {}
    for name, strategy in (
        ("stock", DDPStrategy(process_group_backend="gloo")),
        ("guarded", _guarded(verify_every=2, weights_every=3)),
    ):
        model = _model()
        trainer = _trainer(strategy)
        torch.manual_seed(100 + ctx.rank)  # dropout masks: the same stream in both runs
        trainer.fit(model, _loader())
        runs[name] = {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "global_step": trainer.global_step,
            "calls": model.calls,
            "logged": model.logged,
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "hook_norms": model.hook_norms,
            "after_backward": model.after_backward,
            "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
        }
        if name == "guarded":
            guard = strategy.guard  # type: ignore[attr-defined]
            runs[name]["last_verified"] = guard.last_verified_step
            runs[name]["next_step"] = guard.next_step
            path = Path(tmp) / "guarded.ckpt"
            trainer.save_checkpoint(path)  # every rank: Lightning's save is collective
            out["ckpt"] = str(path)
    out["runs"] = runs

    # Resume from the guarded checkpoint: the guard continues its schedule (steps 6 and 7).
    resumed = _guarded(verify_every=2, weights_every=3)
    trainer = _trainer(resumed, max_steps=STEPS + 2)
    model = _model()
    trainer.fit(model, _loader(), ckpt_path=out["ckpt"])
    guard = resumed.guard
    assert guard is not None
    out["resumed"] = {
        "global_step": trainer.global_step,
        "next_step": guard.next_step,
        "last_verified": guard.last_verified_step,
        "logged": len(model.logged),
    }

    # bf16-mixed (autocast, no scaler): guarded against stock, every step verified.
    bf16 = {}
    for name, strategy in (
        ("stock", DDPStrategy(process_group_backend="gloo")),
        ("guarded", _guarded(verify_every=1)),
    ):
        model = _model()
        trainer = _trainer(strategy, max_steps=3, precision="bf16-mixed")
        torch.manual_seed(100 + ctx.rank)
        trainer.fit(model, _loader())
        bf16[name] = {k: v.clone() for k, v in model.state_dict().items()}
    out["bf16"] = bf16
    return out


def _fault_job(ctx: RankContext, tmp: str) -> dict[str, Any]:
    """Rank part: a persistent fault in rank 1's forward from step 1 (the first sample's whole
    first-layer output scaled by 4, in every pass), under guarded_main as a user's main."""
    torch.set_num_threads(1)
    _launched_externally(ctx)
    incidents = Path(tmp) / "incidents"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(Path(tmp) / f"error{ctx.rank}.json")
    model = _model()
    Fault.at_forward("net.0").scale(4.0, count=32, index=0).persistent(from_step=1).on_rank(1).install(
        model, rank=ctx.rank, world_size=ctx.world_size
    )

    @guarded_main(incident_dir=incidents)
    def main() -> int:
        trainer = _trainer(_guarded(verify_every=2, incident_dir=str(incidents)), devices=ctx.world_size)
        trainer.fit(model, _loader())
        return trainer.global_step

    try:
        return {"returned": main()}
    except SystemExit as exc:
        error = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
        return {
            "code": exc.code,
            "error_file": json.loads(error.read_text()) if error.exists() else None,
            "incidents": [json.loads(p.read_text()) for p in sorted(incidents.glob("*.json"))],
            "calls": model.calls,
        }


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lightning")
    return run_local(_lightning_job, node_names(2, 1), args=(str(tmp),), timeout=150)


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())


@pytest.mark.timeout(180)
def test_guarded_lightning_trains_as_stock_lightning(lightning_results: list[dict[str, Any]]) -> None:
    """Same final weights (whole model), global_step == max_steps, the same LR, the same logged
    losses (the probe and replays are not logged), on_before_optimizer_step and on_after_backward
    once per step on the reduced gradient, and gradient_clip_val applied as stock Lightning does."""
    for r in lightning_results:
        stock, guarded = r["runs"]["stock"], r["runs"]["guarded"]
        assert _rel(guarded["state"], stock["state"]) <= 1e-6
        assert stock["global_step"] == guarded["global_step"] == STEPS
        assert guarded["lr"] == stock["lr"] == pytest.approx(1e-2 * 0.5**3)
        assert guarded["logged"] == stock["logged"] and len(guarded["logged"]) == STEPS
        assert guarded["train_loss"] == stock["train_loss"]
        assert guarded["hook_norms"] == pytest.approx(stock["hook_norms"], rel=1e-6)
        assert min(stock["hook_norms"]) > 4 * CLIP, "the clipping must bite on every step"
        assert guarded["after_backward"] == stock["after_backward"] == STEPS
        # The guard ran the extra probe and replays on top of Lightning's passes.
        assert guarded["calls"] > stock["calls"] == STEPS
        assert (guarded["next_step"], guarded["last_verified"]) == (STEPS, 4)
    # DDP: the ranks hold the same weights.
    rank0, rank1 = (r["runs"]["guarded"]["state"] for r in lightning_results)
    assert _rel(rank1, rank0) == 0


@pytest.mark.timeout(180)
def test_bf16_mixed_under_the_guard_trains_as_stock(lightning_results: list[dict[str, Any]]) -> None:
    """precision='bf16-mixed' (autocast in the training pass, the probe and the replays), every
    step verified: the same weights as stock Lightning."""
    for r in lightning_results:
        assert _rel(r["bf16"]["guarded"], r["bf16"]["stock"]) <= 1e-6


@pytest.mark.timeout(180)
def test_guard_state_rides_in_the_lightning_checkpoint(lightning_results: list[dict[str, Any]]) -> None:
    """trainer.save_checkpoint stores the guard's state; fit(ckpt_path=...) restores it, so the
    resumed guard continues at step 6 and verifies step 6 (verify_every=2). The pass that settles
    DDP's buckets on resume (through the DDP wrapper) logs nothing: two steps, two logged losses."""
    ckpt = torch.load(lightning_results[0]["ckpt"], weights_only=False)
    assert ckpt[CHECKPOINT_KEY]["next_step"] == STEPS
    assert ckpt[CHECKPOINT_KEY]["last_verified_step"] == 4
    for r in lightning_results:
        assert r["resumed"] == {
            "global_step": STEPS + 2,
            "next_step": STEPS + 2,
            "last_verified": STEPS,
            "logged": 2,
        }


@pytest.mark.timeout(180)
def test_forward_fault_on_rank_1_exits_87_naming_its_node(tmp_path: Path) -> None:
    """A persistent forward fault on rank 1 from step 1 is caught at step 2 (the first
    verification after it) on every rank of 3 (a third rank arbitrates); guarded_main exits 87
    with the incident in torchrun's error file, and the incident names rank 1 and its node."""
    results = run_local(_fault_job, node_names(3, 1), args=(str(tmp_path),), timeout=150)
    for r in results:
        assert r.get("code") == EXIT_CORRUPTION, r
        info = r["error_file"]["message"]["extraInfo"]["replicheck_incident"]
        assert (info["step"], info["check"], info["classification"]) == (2, "replay", "persistent")
        assert info["suspect_ranks"] == [1] and info["suspect_nodes"] == ["node1"]
    assert [i["id"] for i in results[0]["incidents"]] == [info["id"]]


# -- refused before training (one process) ---------------------------------------------------
@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launched rank 0 of 1 (no process group is created: every refusal comes before it)."""
    for name, value in {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "1", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"accumulate_grad_batches": 2}, "Use a larger batch"),
        # Lightning itself refuses clipping under manual optimisation.
        ({"manual": True, "gradient_clip_val": None}, "manual optimisation"),
        # On CPU precision="16-mixed" becomes bf16-mixed: the plugin itself, as on a GPU.
        ({"plugins": [MixedPrecision("16-mixed", "cpu")]}, "GradScaler"),
    ],
    ids=["accumulate_grad_batches", "manual_optimisation", "16-mixed"],
)
def test_what_cannot_run_exactly_is_refused_before_training(
    one_process: None, setup: dict[str, Any], message: str
) -> None:
    """accumulate_grad_batches > 1, manual optimisation and 16-mixed (a GradScaler inside
    Lightning) raise GuardConfigError at setup, before the process group and any training_step."""
    kwargs = dict(setup)
    model = _model(manual=kwargs.pop("manual", False))
    trainer = _trainer(_guarded(), devices=1, **kwargs)
    with pytest.raises(GuardConfigError, match=message):
        trainer.fit(model, _loader())
    assert model.calls == 0
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cfg", "message"),
    [({"probe": "split"}, "probe='split'"), ({"max_grad_norm": 1.0}, "gradient_clip_val")],
    ids=["split_probe", "max_grad_norm"],
)
def test_guard_options_lightning_does_differently_are_refused(cfg: dict[str, Any], message: str) -> None:
    """probe='split' (Lightning's pass sees the whole batch) and max_grad_norm (Lightning clips
    with gradient_clip_val) are refused when the strategy is made; a DDP comm hook too."""
    with pytest.raises(GuardConfigError, match=message):
        _guarded(**cfg)
    with pytest.raises(GuardConfigError, match="communication hook"):
        GuardedDDPStrategy(ddp_comm_hook=lambda *a: None)
