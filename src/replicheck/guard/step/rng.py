"""Forking every random number generator a pass can draw from (the CPU's and the devices')."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

_NO_RNG = frozenset({"cpu", "meta"})
"""Device types without a per-device generator of their own (the CPU one is always forked)."""


def rng_devices(devices: Iterable[torch.device], current_index: Callable[[str], int]) -> dict[str, list[int]]:
    """The accelerator generators to fork for ``devices``: device type → sorted distinct indices.

    A device without an index (``cuda``) means that type's current device, which
    ``current_index(type)`` returns. CPU and meta devices add nothing (the CPU generator is forked
    in any case).
    """
    out: dict[str, set[int]] = {}
    for d in devices:
        if d.type in _NO_RNG:
            continue
        out.setdefault(d.type, set()).add(d.index if d.index is not None else current_index(d.type))
    return {kind: sorted(indices) for kind, indices in sorted(out.items())}


def _current_index(device_type: str) -> int:
    index: int = getattr(torch, device_type).current_device()
    return index


@contextlib.contextmanager
def forked_rng(devices: Iterable[torch.device]) -> Iterator[None]:
    """Fork the CPU generator and the generator of every accelerator in ``devices``.

    Whatever the pass draws (dropout on the device, sampling on the host) comes from the forks;
    every generator is back in its state on exit, so the main streams are untouched.
    """
    groups = rng_devices(devices, _current_index)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for kind, indices in groups.items():
            stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
        yield


def generator_states(devices: Iterable[torch.device]) -> list[torch.Tensor]:
    """Host copies of the CPU generator's state and of every accelerator generator of ``devices``
    (a device generator's state is its seed and offset, kept on the host: no device sync)."""
    states = [torch.get_rng_state()]
    for kind, indices in rng_devices(devices, _current_index).items():
        module = getattr(torch, kind)
        states.extend(module.get_rng_state(i) for i in indices)
    return states


def drew_random(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> bool:
    """Whether any generator moved between two :func:`generator_states` (random numbers drawn)."""
    return len(before) != len(after) or any(not torch.equal(b, a) for b, a in zip(before, after))
