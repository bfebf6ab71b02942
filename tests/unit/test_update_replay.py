"""The optimizer-update replay's comparison (plain FSDP2's check of each rank's update): a fresh
optimizer of the same class, stepped on copies of the recorded state, lands within tolerance of
the real step for every replayable optimizer, and a corrupted update of one value does not."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from replicheck.guard.checks.update import REPLAYABLE, judge, replayable, snapshot
from replicheck.guard.transport.batch import pack, unpack
from replicheck.guard.transport.records import UpdateRecord, WireFormatError

CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.Adamax, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-2)),
    (torch.optim.RAdam, dict(lr=1e-2)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    (torch.optim.Rprop, dict(lr=1e-2)),
]


def _stepped(cls: type[torch.optim.Optimizer], kw: dict[str, Any], steps: int) -> torch.optim.Optimizer:
    """An optimizer over two parameters (two groups) after ``steps`` steps, with fresh gradients."""
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    b = torch.nn.Parameter(torch.randn(300, generator=g) * 1e-3)
    opt = cls([{"params": [a]}, {"params": [b], "lr": kw["lr"] / 3}], **kw)
    for _ in range(steps + 1):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = torch.randn(b.shape, generator=g) * 1e-4
        if _ < steps:
            opt.step()
    return opt


def _record(opt: torch.optim.Optimizer) -> UpdateRecord:
    before = snapshot(opt)
    opt.step()
    return UpdateRecord(before=before, after=snapshot(opt, grads=False).params)


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
@pytest.mark.parametrize("steps", [0, 3])
def test_replay_of_a_clean_update_is_within_tolerance(
    cls: type[torch.optim.Optimizer], kw: dict[str, Any], steps: int
) -> None:
    """Replaying a real step (first step, and after three) on a fresh optimizer of the same class
    agrees within tolerance, for every replayable optimizer and its options."""
    opt = _stepped(cls, kw, steps)
    assert replayable(opt)
    ratio, where = judge(opt, _record(opt))
    assert ratio <= 1.0, where


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    flat = t.detach().view(-1)
    bits = struct.unpack("<I", struct.pack("<f", float(flat[index])))[0] ^ (1 << bit)
    flat[index] = struct.unpack("<f", struct.pack("<I", bits))[0]


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_one_corrupted_value_of_the_update_is_outside_tolerance(
    cls: type[torch.optim.Optimizer], kw: dict[str, Any]
) -> None:
    """Bit 22 of one value's delta flipped (the campaign's optimizer-update fault) is caught."""
    opt = _stepped(cls, kw, 3)
    before = snapshot(opt)
    opt.step()
    p = opt.param_groups[0]["params"][0]
    value = before.params[0]["value"]
    assert isinstance(value, torch.Tensor)
    delta = p.detach() - value
    _flip(delta, int(delta.abs().argmax()), 22)  # a value that moved (Rprop leaves some still)
    with torch.no_grad():
        p.copy_(value + delta)
    ratio, where = judge(opt, UpdateRecord(before=before, after=snapshot(opt, grads=False).params))
    assert ratio > 1.0 and where == "parameter 0 value"


def test_corrupted_optimizer_state_is_outside_tolerance() -> None:
    """A wrong value in the state the step wrote (Adam's second moment) is caught too."""
    opt = _stepped(torch.optim.Adam, dict(lr=1e-2), 3)
    record = _record(opt)
    assert record.after is not None
    second_moment = record.after[1]["exp_avg_sq"]
    assert isinstance(second_moment, torch.Tensor)
    second_moment.view(-1)[5] *= 1.5
    ratio, where = judge(opt, record)
    assert ratio > 1.0 and where == "parameter 1 exp_avg_sq"


def test_an_optimizer_that_reads_whole_tensors_is_not_replayable() -> None:
    """Optimizers outside the elementwise list (here a subclass) are not replayed shard by shard."""

    class Custom(torch.optim.SGD):
        pass

    p = torch.nn.Parameter(torch.zeros(3))
    assert not replayable(Custom([p], lr=0.1))
    assert torch.optim.Adafactor not in REPLAYABLE


def test_a_rank_whose_optimizer_did_not_step_sends_an_empty_record() -> None:
    """An empty record (the loss scaler skipped the step there) is no disagreement."""
    opt = _stepped(torch.optim.SGD, dict(lr=0.1), 0)
    assert judge(opt, UpdateRecord(before=None)) == (0.0, "")
    sent = UpdateRecord.decode(UpdateRecord(before=None).encode())
    assert sent == UpdateRecord(before=None)


def test_an_update_record_crosses_ranks_unchanged() -> None:
    """The typed update record survives the wire (encode, pack, unpack, decode) and is judged the
    same there; a message of another kind is refused by name."""
    opt = _stepped(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 3)
    record = _record(opt)
    got = UpdateRecord.decode(unpack(pack(record.encode())))
    assert got.before is not None and record.before is not None
    assert got.before.sizes == record.before.sizes and len(got.before.params) == len(record.before.params)
    assert judge(opt, got) == judge(opt, record)
    with pytest.raises(WireFormatError, match="not an update record"):
        UpdateRecord.decode(("replicheck.probe/1", 0))
