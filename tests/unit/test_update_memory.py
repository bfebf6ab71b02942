"""The optimizer-update replay's memory and host transfers (issue 23, finding 3): the record is
packed on the shard's device (step counters travel as numbers, not host tensors that force the
message onto the host), one counted device→host copy per record, and the check holds no second
copy of the shard while it replays it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from live_bytes import LiveBytes

from replicheck.guard.attribution.ring import Ring
from replicheck.guard.checks import update
from replicheck.guard.checks.update import UpdateReplay, live, snapshot
from replicheck.guard.transport import batch
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import UpdateRecord, UpdateValues
from replicheck.guard.transport.transfer import COUNTER, to_host


def _adamw(device: str, layers: int = 8, width: int = 128) -> torch.optim.Optimizer:
    """AdamW over ``layers`` equal weights after one step, with fresh gradients: its step counters
    are host tensors beside the device state, as on an accelerator."""
    params = [torch.nn.Parameter(torch.randn(width, width, device=device)) for _ in range(layers)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        if _ == 0:
            opt.step()
    return opt


def _meta_to_host(t: torch.Tensor, why: str) -> torch.Tensor:
    """``to_host`` with ``meta`` standing in for an accelerator: counted, and a host tensor of
    the same shape comes back (the copy a real device would make)."""
    if t.device.type != "meta":
        return to_host(t, why)
    COUNTER.count(why)
    return torch.zeros(t.shape, dtype=t.dtype)


def test_an_update_record_is_packed_on_its_device_with_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the shard on a device and AdamW's step counters on the host, building and packing the
    record that goes to the verifier makes one counted device→host copy (the digests), and the
    message stays on the device; a message packed on the host made one copy per state tensor."""
    monkeypatch.setattr(batch, "to_host", _meta_to_host)
    monkeypatch.setattr(update, "to_host", _meta_to_host)
    opt = _adamw("meta", layers=4, width=8)
    before = snapshot(opt)
    opt.step()
    assert all(st["step"].device.type == "cpu" for st in before.params)
    COUNTER.reset()
    light = UpdateRecord(before=before, digests=update.digests(live(opt)))
    message = batch.pack(light.encode())
    assert COUNTER.total == 1, dict(COUNTER.by_reason)
    assert message.device.type == "meta"
    values = batch.pack(UpdateValues(values=live(opt)).encode())
    assert COUNTER.total == 1 and values.device.type == "meta"


def test_step_counters_cross_as_host_tensors_with_their_bits() -> None:
    """A host step counter written as a number comes back a host tensor of its dtype and value."""
    opt = _adamw("cpu", layers=2, width=4)
    before = snapshot(opt)
    got = UpdateRecord.decode(batch.unpack(batch.pack(UpdateRecord(before=before).encode())))
    assert got.before is not None
    for sent, came in zip(before.params, got.before.params):
        step = came["step"]
        assert isinstance(step, torch.Tensor) and step.device.type == "cpu"
        assert step.dtype == sent["step"].dtype and torch.equal(step, sent["step"])  # type: ignore[arg-type]


class _HandedOver(Comm):
    """World size 1 with the record handed over as the object itself (no message copies)."""

    def exchange(self, sends: Sequence[tuple[int, object]], recv_from: Sequence[int]) -> dict[int, object]:
        return {src: obj for (_, obj), src in zip(sends, recv_from)}


def test_the_update_check_holds_no_second_copy_of_the_shard() -> None:
    """The check (world size 1: this rank replays its own record) reads the new values in place
    and replays the shard a part at a time: the memory it allocates at any moment stays below half
    of one copy of the shard's record (weights, gradients, optimizer state). It used to copy the
    new values (3/4 of a record) and replay a whole second copy beside them.

    The message's own copies (the packed record and its decoded copy, which world size 1 also
    makes since its exchange runs the real message path) are the exchange's, not the check's:
    here the record is handed over as an object, so only what the check holds is measured."""
    opt = _adamw("cpu")
    replay = UpdateReplay(opt, _HandedOver(), Ring(order=(0,), nodes=("n0",)))
    replay.arm()
    opt.step()
    record = sum(
        t.numel() * t.element_size()
        for g in opt.param_groups
        for p in g["params"]
        for t in (p, p.grad, *opt.state[p].values())
        if isinstance(t, torch.Tensor)
    )
    with LiveBytes() as mem:
        assert replay.check(0) is None
    assert mem.peak <= 0.5 * record, (mem.peak, record)
