"""Strictly deterministic kernels for probe passes, and the clear error when a model has none.

Exact mode compares probe gradients bit for bit, so every probe pass (the source's probe, the
verifier's replay, arbitration and re-runs) must run kernels that give the same bits every time.
``warn_only=True`` is not enough: it keeps the non-deterministic kernel (SDPA's flash and
memory-efficient backward on GPU, for one) and only warns, and exact mode then false-alarms.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, MutableMapping

import torch
import torch.utils.deterministic
from torch.nn.attention import SDPBackend, sdpa_kernel

from replicheck.guard.config import ProbeAttention
from replicheck.guard.errors import DeterminismError, GuardConfigError

log = logging.getLogger(__name__)

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_SETTING = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
_NO_KERNEL = re.compile(r"(\S+) does not have a deterministic implementation")
_ADVICE = (
    "Probe passes in exact mode run with torch.use_deterministic_algorithms(True) so that a replay "
    "gives the same bits. Either use GuardConfig(mode='tolerant') (default kernels, gradients "
    "compared within a calibrated tolerance; keep deterministic unset or False), or replace the "
    "operation with one that has a deterministic kernel."
)


@contextlib.contextmanager
def deterministic(enabled: bool, attention: ProbeAttention = "math") -> Iterator[None]:
    """Strictly deterministic kernels for one pass; every setting is restored afterwards.

    Turns on ``torch.use_deterministic_algorithms(True)`` (errors, not warnings) and makes cuDNN
    deterministic without autotuning. ``attention="math"`` also pins scaled-dot-product
    attention to the math backend; ``"default"`` leaves the backend to torch (its flash and
    memory-efficient backward are deterministic under these settings, to be confirmed on a GPU:
    ``GuardConfig.probe_attention``). Uninitialised memory is not filled with NaN (torch does so
    under deterministic algorithms; a correct kernel never reads it, and the fill costs a full write
    per allocation). An operation without a deterministic kernel raises
    :class:`DeterminismError` naming it.
    """
    if not enabled:
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    pin = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    with pin:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        try:
            yield
        except RuntimeError as exc:
            err = determinism_error(exc)
            if err is None:
                raise
            raise err from exc
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev_cudnn
            torch.utils.deterministic.fill_uninitialized_memory = prev_fill  # type: ignore[attr-defined]


def determinism_error(exc: BaseException) -> DeterminismError | None:
    """The typed error for torch's refusal of a non-deterministic kernel, or ``None`` for others."""
    text = str(exc)
    match = _NO_KERNEL.search(text)
    if match is not None:
        op = match.group(1)
        return DeterminismError(
            f"{op} has no deterministic kernel, so a probe pass cannot be checked bit for bit. "
            f"{_ADVICE} (torch: {text.splitlines()[0] if text else ''})",
            op=op,
        )
    if CUBLAS_ENV in text:
        return DeterminismError(
            f"cuBLAS is not configured for deterministic results: export {CUBLAS_ENV}={CUBLAS_SETTING} "
            "before the training process starts, or use GuardConfig(mode='tolerant'). "
            f"(torch: {text.splitlines()[0]})"
        )
    return None


def prepare_cublas(
    device: torch.device,
    enabled: bool,
    *,
    environ: MutableMapping[str, str] | None = None,
    cuda_initialized: bool | None = None,
) -> bool:
    """Make sure cuBLAS can run deterministically on ``device``; ``True`` when it set the variable.

    cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when the process first uses it, so it must be in the
    environment before then. Unset before CUDA starts: it is set to ``:4096:8`` (logged). Unset
    once CUDA is running (the usual case by the time a guard wraps a model on the GPU), or set to
    a value cuBLAS is not deterministic with: :class:`GuardConfigError` saying what to export.
    Nothing is checked on other devices or without deterministic kernels.
    """
    if not enabled or device.type != "cuda":
        return False
    env = os.environ if environ is None else environ
    value = env.get(CUBLAS_ENV)
    if value in _CUBLAS_DETERMINISTIC:
        return False
    fix = (
        f"export {CUBLAS_ENV}={CUBLAS_SETTING} (or :16:8) before the training process starts, or use "
        "GuardConfig(mode='tolerant') to run probe passes on the default kernels"
    )
    if value is not None:
        raise GuardConfigError(f"{CUBLAS_ENV}={value!r} does not make cuBLAS deterministic: {fix}")
    started = (
        torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if cuda_initialized is None
        else cuda_initialized
    )
    if started:
        raise GuardConfigError(
            f"exact mode needs deterministic cuBLAS, and {CUBLAS_ENV} was not set before CUDA "
            f"started in this process (cuBLAS reads it once): {fix}"
        )
    env[CUBLAS_ENV] = CUBLAS_SETTING
    log.info("set %s=%s for deterministic cuBLAS on probe passes", CUBLAS_ENV, CUBLAS_SETTING)
    return True
