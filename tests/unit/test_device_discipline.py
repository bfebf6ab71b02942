"""Where the guard's tensors live and where they cross (issue 23, findings 1, 7, 8 and 10).

No GPU here: the communication device is made different from the compute device with a ``meta``
stand-in whose bytes travel beside it (:func:`_meta_loopback`), so every seam of the message
path (packed, moved to the communication device, read back on the host, decoded, replayed,
compared) is observed as it would be under NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

from replicheck import fingerprint as fp
from replicheck.guard import Guard, GuardConfig
from replicheck.guard.attribution import compare as compare_mod
from replicheck.guard.attribution.resolve import Criterion
from replicheck.guard.errors import CommError
from replicheck.guard.parallel.single import SingleProcess
from replicheck.guard.step import replay as replay_mod
from replicheck.guard.step import verify as verify_mod
from replicheck.guard.transport import batch as batch_mod
from replicheck.guard.transport import comm as comm_mod
from replicheck.guard.transport.batch import pack, tree_leaves, unpack
from replicheck.guard.transport.comm import Comm, comm_device, device_backends
from replicheck.guard.transport.records import PlacementError, ProbePayload, ProbeResult
from replicheck.guard.transport.transfer import COUNTER

CUDA = torch.device("cuda", 3)
"""A stand-in accelerator device: only a name here, no tensor is made on it."""


# -- finding 7: which device the guard's messages use ----------------------------------------


@pytest.mark.parametrize(
    ("config", "compute", "expected"),
    [
        ("nccl", CUDA, CUDA),
        ("cuda:nccl", CUDA, CUDA),
        ("cpu:gloo,cuda:nccl", CUDA, CUDA),  # torch's per-device backends
        ("undefined", CUDA, CUDA),  # init_process_group() without a backend
        ("", CUDA, CUDA),
        ("gloo", CUDA, torch.device("cpu")),  # gloo stages device tensors through the host
        ("cpu:gloo,cuda:gloo", CUDA, torch.device("cpu")),
        ("gloo", torch.device("cpu"), torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cpu"), torch.device("cpu")),
        ("undefined", torch.device("cpu"), torch.device("cpu")),
    ],
)
def test_comm_device_follows_the_backend_for_the_models_device(
    config: str, compute: torch.device, expected: torch.device
) -> None:
    """The communication device is the model's compute device (index included: 8 ranks that
    never called set_device still use their own GPU) when the group has a device backend for its
    type, whatever the spelling of the backend; the host when the group moves it through the host."""
    assert comm_device(config, compute) == expected


def test_a_backend_that_moves_nothing_the_model_has_is_refused() -> None:
    """An NCCL-only group with a model on the host, or a malformed configuration, is a clear error."""
    with pytest.raises(CommError, match="moves neither"):
        comm_device("nccl", torch.device("cpu"))
    with pytest.raises(CommError, match="cannot read"):
        device_backends("cpu:gloo,cuda")
    assert device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}


def test_the_communication_device_can_be_injected() -> None:
    """``Comm(device=...)`` sets the communication device (what the tests below rely on)."""
    assert Comm(device=torch.device("meta")).device == torch.device("meta")
    assert Comm(compute=torch.device("cpu")).device == torch.device("cpu")


# -- finding 1: the message path with a communication device that is not the compute device ----


@contextlib.contextmanager
def _meta_loopback() -> Iterator[list[torch.device]]:
    """Messages moved to ``meta`` (the stand-in communication device) keep their bytes beside
    them, and the host read-back of a meta message returns those bytes: the path is the real one
    (pack → ``.to(comm.device)`` → the counted host transfer → decode), only the bytes take a
    side road a meta tensor cannot hold. Yields the devices the received messages were on."""
    sent: list[torch.Tensor] = []
    seen: list[torch.device] = []
    real_pack, real_to_host = comm_mod.pack, batch_mod.to_host

    def spy_pack(obj: Any) -> torch.Tensor:
        data = real_pack(obj)
        sent.append(data)
        return data

    def read_back(t: torch.Tensor, why: str) -> torch.Tensor:
        seen.append(t.device)
        if t.device.type == "meta":
            data = sent.pop(0)
            assert data.shape == t.shape
            return real_to_host(data, why)
        return real_to_host(t, why)

    with mock.patch.object(comm_mod, "pack", spy_pack), mock.patch.object(batch_mod, "to_host", read_back):
        yield seen


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_world_size_one_exchange_runs_the_real_message_path() -> None:
    """At world size 1 the exchange does not hand the sender's objects over: the message is
    packed, moved to the communication device, read back once (counted) and decoded on the host
    into tensors of their own."""
    comm = Comm(device=torch.device("meta"))
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    COUNTER.reset()
    with _meta_loopback() as seen:
        got = comm.exchange([(0, {"x": x, "n": 3})], [0])[0]
    assert seen == [torch.device("meta")]
    assert COUNTER.by_reason["received message"] == 1
    assert isinstance(got, dict) and got["n"] == 3
    assert got["x"] is not x and torch.equal(got["x"], x)
    assert got["x"].device == torch.device("cpu") and _owns_storage(got["x"])


def test_decoded_tensors_are_host_tensors_with_their_own_storage() -> None:
    """Every decoded tensor is a host tensor in its own allocation (storage offset 0), not a
    16-byte-aligned view into the received buffer, and keeps dtype, shape and values."""
    obj = {
        "a": torch.arange(5, dtype=torch.uint8),
        "b": torch.randn(3, 7, dtype=torch.float64),
        "c": torch.randn(4, 2).to(torch.bfloat16)[:, 1],  # a strided view on the sender
    }
    got = unpack(pack(obj))
    for k, t in obj.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        assert _owns_storage(got[k]), k


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    return out


def _spy(target: Any, name: str, log: list[Any]) -> Any:
    real = getattr(target, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        log.append((args, kwargs, out))
        return out

    return mock.patch.object(target, name, call)


def _devices(tree: Any) -> set[torch.device]:
    return {t.device for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("mode", ["exact", "tolerant"])
def test_every_seam_of_a_verification_has_its_tensors_where_the_rule_puts_them(mode: str) -> None:
    """A world-size-1 guard whose communication device (meta) is not its compute device (the
    host) verifies its probe through the message path: the received payload is decoded on the
    host (fingerprint and batch, each tensor its own), the replay's result is on the host, and
    both inputs of every comparison are on the host."""
    model = _model()
    par = SingleProcess(model)
    par.comm.device = torch.device("meta")
    cfg = GuardConfig(mode=mode, verify_every=1, probe_size=2, calibration_verifications=1)  # type: ignore[arg-type]
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), _loss, cfg, node="n0", parallelism=par)
    decoded: list[Any] = []
    replayed: list[Any] = []
    compared: list[Any] = []
    g = torch.Generator().manual_seed(1)
    with (
        _meta_loopback() as seen,
        _spy(ProbePayload, "decode", decoded),
        _spy(replay_mod.Recompute, "payload", replayed),
        _spy(verify_mod, "compare", compared),
    ):
        for _ in range(2):
            guard.step((torch.randn(8, 6, generator=g), torch.randn(8, generator=g)))
    assert seen and set(seen) == {torch.device("meta")}  # every message crossed the stand-in
    assert len(decoded) == 2
    for _, _, payload in decoded:
        assert payload.result.fingerprint.device.type == "cpu"
        assert _devices(payload.batch) == {torch.device("cpu")}
        assert all(_owns_storage(t) for t in tree_leaves(payload.batch))
    assert replayed and all(r.fingerprint.device.type == "cpu" for _, _, r in replayed)
    assert compared
    for args, _, _ in compared:
        a, b = args[0], args[1]
        assert a.fingerprint.device == b.fingerprint.device == torch.device("cpu")


def test_a_probe_result_off_the_host_is_refused_where_it_is_made() -> None:
    """The rule for probe results (fingerprints on the host) is checked when one is made, so a
    comparison or an arbiter's criterion can never be handed two devices."""
    with pytest.raises(PlacementError, match="on the host"):
        ProbeResult(loss=1.0, fingerprint=torch.zeros(3, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize("mode", ["exact", "tolerant"])
def test_the_arbiters_criterion_takes_a_decoded_result_and_a_replayed_one(mode: str) -> None:
    """An arbiter compares a result decoded from an arbitration request with its own replay's
    (both on the host): the same values agree, a changed one does not."""
    fpr = (
        fp.digests([torch.ones(3), torch.zeros(2)])
        if mode == "exact"
        else fp.sketches([torch.ones(3), torch.zeros(2)], seed=1, k=4, block=64)
    )
    mine = ProbeResult(loss=0.5, fingerprint=fpr)
    received = unpack(pack(mine))
    assert received.fingerprint.device.type == "cpu" and received is not mine
    crit = Criterion(mode=mode, threshold=1e-6)  # type: ignore[arg-type]
    assert crit.agree(received, mine)
    assert not crit.agree(received, ProbeResult(loss=0.5, fingerprint=fpr + 1))


def test_compare_rejects_nothing_it_is_given_on_the_host() -> None:
    """``compare`` works on the host results the rule guarantees (exact: bit for bit)."""
    a = ProbeResult(loss=1.0, fingerprint=torch.tensor([1, 2], dtype=torch.int64))
    b = ProbeResult(loss=1.0, fingerprint=torch.tensor([1, 3], dtype=torch.int64))
    assert compare_mod.compare(a, b, "exact", 0.0).differing == (1,)


# -- finding 10: the digest depends on values, dtype and shape only ---------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_the_digest_of_a_view_equals_the_digest_of_its_clone(dtype: torch.dtype, offset: int) -> None:
    """A view that starts at a storage offset that is not a multiple of a word digests as its
    clone does (small and large tensors, which take different paths)."""
    for n in (64, 4096):
        base = (torch.arange(n + 8) * 7 % 251).to(dtype)
        view = base[offset : offset + n]
        assert view.storage_offset() == offset
        assert fp.tensor_digest(view) == fp.tensor_digest(view.clone()), (dtype, offset, n)
        assert torch.equal(fp.digests([view]), fp.digests([view.clone()]))


# -- finding 8: probe passes run and are seeded on the compute device ------------------------


class _Offloaded(SingleProcess):
    """A parallelism whose compute device (a stand-in name) is not where its parameters are."""

    @property
    def device(self) -> torch.device:
        return CUDA


def test_replays_use_the_parallelisms_compute_device_not_the_parameters() -> None:
    """Replays move their batch to, and seed, the parallelism's compute device (under FSDP2's
    CPU offload the GPU, while the parameters are on the host)."""
    model = _model()
    par = _Offloaded(model)
    rc = replay_mod.Recompute(
        par,
        _loss,
        list(model.parameters()),
        replay_mod.Fingerprinter("exact", 4),
        deterministic_kernels=False,
    )
    assert rc._device == CUDA
    assert CUDA in rc._devices


def test_seeding_forks_and_seeds_the_compute_devices_generator() -> None:
    """``seeded(seed, cuda:3)`` forks the CPU's generator and that of cuda:3 (a recording stand-in
    for torch's fork_rng: no CUDA here), so a probe's GPU dropout is seeded and the main GPU
    stream is restored."""
    forked: list[tuple[list[int], str]] = []

    @contextlib.contextmanager
    def fake_fork(devices: Any = None, device_type: str = "cuda", **_: Any) -> Iterator[None]:
        forked.append((list(devices or []), device_type))
        yield

    with mock.patch.object(torch.random, "fork_rng", fake_fork), mock.patch.object(torch, "manual_seed"):
        with replay_mod.seeded(5, CUDA):
            pass
    assert ([3], "cuda") in forked and ([], "cuda") in forked
