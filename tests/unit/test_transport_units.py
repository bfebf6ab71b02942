"""Units of the GPU transport fixes: batches moved to the module's device, forked device RNGs,
strictly deterministic probe passes and the cuBLAS workspace setting."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from replicheck.guard import DeterminismError, GuardConfigError
from replicheck.guard.step.determinism import determinism_error, deterministic, prepare_cublas
from replicheck.guard.step.rng import forked_rng, rng_devices
from replicheck.guard.transport.batch import pack, to_device, unpack


class Pair(NamedTuple):
    a: torch.Tensor
    b: Any


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    tag: str
    inner: Pair


def _nested() -> dict[str, Any]:
    return {
        "ids": torch.arange(4),
        "list": [torch.ones(2), (torch.zeros(2), 3)],
        "pair": Pair(torch.ones(1), {"deep": torch.full((2,), 2.0)}),
        "record": Record(x=torch.ones(3), tag="t", inner=Pair(torch.zeros(1), [torch.ones(1)])),
        "name": "kept",
    }


def _leaves(batch: Any) -> list[torch.Tensor]:
    from replicheck.guard.transport.batch import tree_leaves

    return [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]


def test_to_device_moves_every_tensor_of_every_container_kind() -> None:
    """Tensors inside dicts, lists, tuples, named tuples and dataclasses all reach the device;
    containers keep their types and non-tensor leaves stay as they were."""
    batch = _nested()
    moved = to_device(batch, torch.device("meta"))
    leaves = _leaves(moved)
    assert len(leaves) == 8 and all(t.device.type == "meta" for t in leaves)
    assert isinstance(moved["pair"], Pair) and isinstance(moved["record"], Record)
    assert isinstance(moved["record"].inner, Pair) and isinstance(moved["list"][1], tuple)
    assert moved["name"] == "kept" and moved["record"].tag == "t" and moved["list"][1][1] == 3
    assert all(t.device.type == "cpu" for t in _leaves(batch))  # the input is not modified


def test_to_device_after_the_wire_puts_a_decoded_batch_on_the_device() -> None:
    """A batch decoded from the wire (on the host) is moved whole, records rebuilt as their classes."""
    decoded = unpack(pack(_nested()))
    moved = to_device(decoded, torch.device("meta"))
    assert isinstance(moved["record"], Record) and isinstance(moved["pair"], Pair)
    assert all(t.device.type == "meta" for t in _leaves(moved))


def test_to_device_keeps_tensors_already_there() -> None:
    """A tensor already on the target device is the same object (no copy)."""
    t = torch.ones(2)
    assert to_device({"t": t}, torch.device("cpu"))["t"] is t


def test_to_device_copies_pinned_host_memory_asynchronously() -> None:
    """Only pinned host tensors going to an accelerator are copied with non_blocking=True."""
    calls: list[bool] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(bool(kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", spy):
        with mock.patch.object(torch.Tensor, "is_pinned", lambda self, *a: True):
            to_device([torch.ones(1)], torch.device("meta"))
        with mock.patch.object(torch.Tensor, "is_pinned", lambda self, *a: False):
            to_device([torch.ones(1)], torch.device("meta"))
    assert calls == [True, False]


def test_rng_devices_lists_each_accelerator_once() -> None:
    """Accelerators are grouped by type with distinct sorted indices; an unindexed device means the
    current one; CPU and meta add nothing."""
    devices = [
        torch.device("cuda", 1),
        torch.device("cpu"),
        torch.device("cuda", 0),
        torch.device("cuda"),
        torch.device("cuda", 1),
        torch.device("meta"),
        torch.device("xpu", 0),
    ]
    assert rng_devices(devices, lambda kind: {"cuda": 3}[kind]) == {"cuda": [0, 1, 3], "xpu": [0]}
    assert rng_devices([torch.device("cpu")], lambda kind: 0) == {}


def test_forked_rng_leaves_the_main_stream_untouched() -> None:
    """Draws inside the fork do not advance the CPU generator."""
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with forked_rng([torch.device("cpu"), torch.device("meta")]):
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected)


def test_deterministic_is_strict_pins_math_attention_and_restores() -> None:
    """Inside: errors (not warnings) for non-deterministic kernels, only the math SDPA backend,
    deterministic cuDNN; outside: the user's own settings, warn_only included."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    try:
        with deterministic(True):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert not torch.backends.cuda.mem_efficient_sdp_enabled()
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        assert torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False


def test_an_op_without_a_deterministic_kernel_gives_the_typed_error() -> None:
    """max_unpool has no deterministic CPU kernel: DeterminismError names it and says what to do,
    and the settings are restored after the error."""
    x, idx = F.max_pool1d(torch.randn(1, 1, 4), 2, return_indices=True)
    with pytest.raises(DeterminismError, match="mode='tolerant'") as info, deterministic(True):
        F.max_unpool1d(x, idx, 2)
    assert info.value.op is not None and "max_unpool" in info.value.op
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_other_runtime_errors_pass_through_unchanged() -> None:
    """Only torch's determinism refusals are translated; other errors keep their type."""
    with pytest.raises(RuntimeError, match="boom") as info, deterministic(True):
        raise RuntimeError("boom")
    assert not isinstance(info.value, DeterminismError)


def test_cublas_refusal_says_what_to_export() -> None:
    """torch's cuBLAS workspace refusal becomes a DeterminismError with the variable to export."""
    err = determinism_error(
        RuntimeError("Deterministic behavior was enabled ... you must set CUBLAS_WORKSPACE_CONFIG=:4096:8")
    )
    assert isinstance(err, DeterminismError) and "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in str(err)


def test_prepare_cublas(caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA with deterministic kernels: set (and logged) before CUDA starts, a clear error after
    it started or for a value that is not deterministic; nothing on CPU or without determinism."""
    cuda = torch.device("cuda", 0)
    env: dict[str, str] = {}
    assert not prepare_cublas(torch.device("cpu"), True, environ=env, cuda_initialized=False)
    assert not prepare_cublas(cuda, False, environ=env, cuda_initialized=True)
    assert env == {}
    with caplog.at_level(logging.INFO, logger="replicheck.guard.step.determinism"):
        assert prepare_cublas(cuda, True, environ=env, cuda_initialized=False)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} and "CUBLAS_WORKSPACE_CONFIG" in caplog.text
    assert not prepare_cublas(cuda, True, environ={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, cuda_initialized=True)
    with pytest.raises(GuardConfigError, match="export CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        prepare_cublas(cuda, True, environ={}, cuda_initialized=True)
    with pytest.raises(GuardConfigError, match="does not make cuBLAS deterministic"):
        prepare_cublas(cuda, True, environ={"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, cuda_initialized=False)
