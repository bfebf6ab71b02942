"""The guard in a Hugging Face Accelerate loop (issue 24): ``accumulate(2)`` with clipping in the
plain Accelerate loop against ``windows`` + ``guard_for`` + ``GuardConfig(max_grad_norm=...)``,
2 gloo ranks, the real ``accelerate`` package; ``accelerator.accumulate`` around ``guard.step``
refused before it can look like hardware."""

from __future__ import annotations

import os
from typing import Any

import accelerate
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replicheck.guard import GuardConfig, GuardConfigError, GuardMisuseError
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.integrations.accelerate import guard_for, windows

STEPS = 6
ACCUMULATE = 2
CLIP = 0.05


class _Net(nn.Module):
    """A small MLP with dropout: the guard must leave the training pass's masks alone."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x))))


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches, as a sharded loader would hand them out."""
    out = []
    for i in range(STEPS * ACCUMULATE):
        g = torch.Generator().manual_seed(100 * i + rank)
        out.append({"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 4, generator=g)})
    return out


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _accelerate_job(ctx: RankContext, ckpt: str) -> dict[str, Any]:
    """Rank part: the plain Accelerate loop, then the guarded one, with one Accelerator."""
    # The process group is up already; Accelerate reads the launcher's variables to see it.
    os.environ.update(
        RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), MASTER_ADDR="127.0.0.1"
    )
    os.environ.setdefault("MASTER_PORT", "29500")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)

    def prepared() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        net = _Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
        return accelerator.prepare(net, opt, sched)

    model, opt, sched = prepared()
    torch.manual_seed(10 + ctx.rank)
    plain_norms = []
    for batch in _batches(ctx.rank):
        with accelerator.accumulate(model):
            accelerator.backward(_mse(model, batch))
            if accelerator.sync_gradients:
                plain_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
    want = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    plain_lr = sched.get_last_lr()

    model, opt, sched = prepared()
    guard = guard_for(
        accelerator, model, opt, _mse, GuardConfig(verify_every=2, max_grad_norm=CLIP), node=ctx.node
    )
    torch.manual_seed(10 + ctx.rank)
    norms, verified = [], []
    for window in windows(_batches(ctx.rank), accelerator):
        result = guard.step(*window)
        norms.append(result.grad_norm)
        verified.append(result.verified)
        sched.step()
        opt.zero_grad()
    got = accelerator.unwrap_model(model).state_dict()
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want]).norm()
    rel = float(diff / torch.cat([v.flatten() for v in want.values()]).norm())

    misuse = ""
    try:
        with accelerator.accumulate(model):
            guard.step(_batches(ctx.rank)[0])
    except GuardMisuseError as exc:
        misuse = str(exc)
    # The guard's state rides in Accelerate's own checkpoint, and a new guard continues from it
    # (a second Accelerator, so that the checkpoint holds one model, the one restored).
    saver = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    net2 = _Net()
    model2, opt2 = saver.prepare(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2))
    resumed = guard_for(saver, model2, opt2, _mse, GuardConfig(verify_every=2), node=ctx.node)
    saver.register_for_checkpointing(guard)
    saver.save_state(ckpt)
    saver.wait_for_everyone()  # rank 0 writes the shared files
    saver._custom_objects.clear()  # restore into the new guard only
    saver.register_for_checkpointing(resumed)
    saver.load_state(ckpt)
    state = (resumed.next_step, resumed.last_verified_step, guard.next_step, guard.last_verified_step)

    return {
        "rel": rel,
        "norms": norms,
        "plain_norms": plain_norms,
        "verified": verified,
        "lr": (sched.get_last_lr(), plain_lr),
        "misuse": misuse,
        "state": state,
    }


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("accelerate") / "state"
    return run_local(_accelerate_job, node_names(2, 1), args=(str(ckpt),), timeout=180)


@pytest.mark.timeout(240)
def test_guarded_accelerate_loop_matches_accumulate_with_clipping(
    accelerate_results: list[dict[str, Any]],
) -> None:
    """accumulate(2) with clip_grad_norm_ on sync steps in the plain Accelerate loop and
    windows() + guard_for(max_grad_norm) apply the same update (1e-6 relative, whole model,
    2 ranks, dropout, a LinearLR schedule, verify every 2), the clipping bites, the reported
    pre-clip norm is clip_grad_norm_'s return on every step and rank, and the schedule ends alike."""
    for r in accelerate_results:
        assert r["rel"] <= 1e-6, r["rel"]
        assert len(r["norms"]) == STEPS == len(r["plain_norms"])
        assert sum(n > CLIP for n in r["plain_norms"]) >= STEPS // 2
        for got, want in zip(r["norms"], r["plain_norms"]):
            assert got == pytest.approx(want, rel=1e-4)
        assert r["verified"] == [s % 2 == 0 for s in range(STEPS)]
        assert r["lr"][0] == pytest.approx(r["lr"][1])


@pytest.mark.timeout(240)
def test_accumulate_around_guard_step_is_refused_as_misuse(accelerate_results: list[dict[str, Any]]) -> None:
    """guard.step inside accelerator.accumulate (DDP's gradient sync off on the window's first
    micro-batch) raises GuardMisuseError telling to pass the window to one guard.step call."""
    for r in accelerate_results:
        assert "guard.step(mb1, mb2, ...)" in r["misuse"], r["misuse"]


@pytest.mark.timeout(240)
def test_the_guard_state_rides_in_accelerates_checkpoint(accelerate_results: list[dict[str, Any]]) -> None:
    """accelerator.register_for_checkpointing(guard) puts Guard.state_dict() in save_state's
    folder, and load_state restores it into a new guard: it continues at the saved next step
    with the saved newest verified step."""
    for r in accelerate_results:
        next_step, verified, want_next, want_verified = r["state"]
        assert (next_step, verified) == (want_next, want_verified) == (STEPS, STEPS - 2)


def test_windows_group_the_loader_into_steps_with_a_short_last_one() -> None:
    """windows() yields gradient_accumulation_steps micro-batches per step and the remainder as
    a last, shorter window (Accelerate's end of the dataloader), and refuses a count below 1."""
    assert list(windows(range(5), 2)) == [(0, 1), (2, 3), (4,)]
    assert list(windows(range(4), 1)) == [(0,), (1,), (2,), (3,)]
    with pytest.raises(GuardConfigError):
        list(windows(range(3), 0))
