"""The holder that keeps tensors given to gloo alive until its worker thread has released them."""

from __future__ import annotations

import time

import torch

from replicheck.guard.transport.inflight import InFlight


def test_a_tensor_is_held_while_something_else_refers_to_it_and_dropped_after() -> None:
    """A held tensor that another owner (here a view, standing for the backend) still refers to
    stays held; once that owner lets go, the next hold() drops it."""
    holder = InFlight()
    t = torch.zeros(4)
    other = t.view(2, 2)  # a second reference to t's TensorImpl, as a pending gloo operation has
    holder.hold([t])
    holder.hold([torch.ones(1)])
    assert len(holder) == 2
    del other
    holder.hold([torch.ones(1)])
    assert len(holder) == 1  # t released; only the newest (still unchecked) tensor is held


def test_drain_waits_for_release_but_no_longer_than_its_bound() -> None:
    """drain() returns at once when nothing is in use, after its bound when something stays in
    use, and holds nothing afterwards either way."""
    free = InFlight(exit_wait_s=5.0)
    free.hold([torch.zeros(2)])
    t0 = time.monotonic()
    free.drain()
    assert time.monotonic() - t0 < 1.0 and len(free) == 0
    stuck = InFlight(exit_wait_s=0.2)
    t = torch.zeros(2)
    keep = t.view(2)
    stuck.hold([t])
    t0 = time.monotonic()
    stuck.drain()
    assert 0.2 <= time.monotonic() - t0 < 2.0 and len(stuck) == 0
    del keep
