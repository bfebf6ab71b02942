"""The data that crosses ranks during a step, each with one encode and one decode.

* :class:`StepRow` — the int64 row every rank contributes to the step's single all-gather.
* :class:`ProbePayload` — a probe as its source sends it to its verifier.
* :class:`ArbitrationRequest` — a disputed probe and the verifier's replay, sent to an arbiter.

Point-to-point messages travel through ``torch.save``/``torch.load(weights_only=True)``, so the
encoded forms are tagged tuples of tensors, numbers and strings (plus the user's batch pytree).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from replicheck.guard.errors import GuardError

_PROBE_TAG = "replicheck.probe/1"
_ARBITRATION_TAG = "replicheck.arbitration/1"


class WireFormatError(GuardError):
    """A message received from another rank does not have the expected shape."""


def float_bits(x: float) -> int:
    """The bits of a float64 as a signed 64-bit integer (so it rides in an int64 row)."""
    bits: int = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits


def bits_float(x: int) -> float:
    """Inverse of :func:`float_bits`."""
    value: float = struct.unpack("<d", struct.pack("<q", x))[0]
    return value


@dataclass(frozen=True)
class ProbeResult:
    """Loss and gradient fingerprint of one probe computation."""

    loss: float
    """The probe's loss (unweighted mean over the probe)."""
    fingerprint: torch.Tensor
    """int64 digests, one per parameter (exact mode), or float64 sketches, rows of blocks of
    parameters (tolerant mode)."""


@dataclass(frozen=True)
class ProbePayload:
    """A rank's probe: what its verifier needs to replay it, and the result the source claims."""

    step: int
    """The step the probe belongs to."""
    source: int
    """The rank that computed it."""
    batch: Any
    """The probe's samples (a pytree of tensors)."""
    weight: float
    """Its share of the source's loss (probe samples / samples of the step)."""
    seed: int
    """The seed the probe ran under (every replay uses the same)."""
    size: int
    """Samples in the probe."""
    result: ProbeResult
    """The loss and fingerprint the source computed."""

    def encode(self) -> tuple[object, ...]:
        return (
            _PROBE_TAG,
            self.step,
            self.source,
            self.batch,
            self.weight,
            self.seed,
            self.size,
            self.result.loss,
            self.result.fingerprint,
        )

    @classmethod
    def decode(cls, wire: object) -> ProbePayload:
        if not (isinstance(wire, tuple) and len(wire) == 9 and wire[0] == _PROBE_TAG):
            raise WireFormatError(f"not a probe payload: {type(wire).__name__}")
        _, step, source, batch, weight, seed, size, loss, fingerprint = wire
        if not isinstance(fingerprint, torch.Tensor):
            raise WireFormatError("probe payload without a fingerprint tensor")
        return cls(
            step=int(step),
            source=int(source),
            batch=batch,
            weight=float(weight),
            seed=int(seed),
            size=int(size),
            result=ProbeResult(loss=float(loss), fingerprint=fingerprint),
        )


@dataclass(frozen=True)
class ArbitrationRequest:
    """A disputed probe, forwarded by its verifier to an arbiter with the verifier's replay."""

    payload: ProbePayload
    """The source's payload, as the verifier received it."""
    verifier_result: ProbeResult
    """What the verifier's replay of it gave."""

    def encode(self) -> tuple[object, ...]:
        return (
            _ARBITRATION_TAG,
            self.payload.encode(),
            self.verifier_result.loss,
            self.verifier_result.fingerprint,
        )

    @classmethod
    def decode(cls, wire: object) -> ArbitrationRequest:
        if not (isinstance(wire, tuple) and len(wire) == 4 and wire[0] == _ARBITRATION_TAG):
            raise WireFormatError(f"not an arbitration request: {type(wire).__name__}")
        _, payload, loss, fingerprint = wire
        if not isinstance(fingerprint, torch.Tensor):
            raise WireFormatError("arbitration request without the verifier's fingerprint tensor")
        return cls(
            payload=ProbePayload.decode(payload),
            verifier_result=ProbeResult(loss=float(loss), fingerprint=fingerprint),
        )


F = TypeVar("F", bound=float | torch.Tensor)
I = TypeVar("I", bound=int | torch.Tensor)  # noqa: E741 - the int fields' type


@dataclass(frozen=True)
class StepRow(Generic[F, I]):
    """What one rank reports in the step's all-gather (floats travel as their bits).

    Every field may also be a 0-dim tensor on the rank's device, so the row is built there and
    crosses to the host once, after the all-gather; :meth:`decode` gives plain numbers.
    """

    loss: F
    """The rank's loss for the step."""
    local_norm: F
    """Norm of the rank's local gradient before the all-reduce."""
    reduced: I
    """Digest of the all-reduced gradient (0 when not checked)."""
    weights: I | int = 0
    """Digest of the weights (on replica-check steps)."""
    optimizer: I | int = 0
    """Digest of the optimizer state (on replica-check steps)."""
    verified: bool = False
    """The rank replayed its source's probe this step."""
    pair_distance: F | float = 0.0
    """Distance between the source's claimed probe result and this rank's replay of it."""
    noise: F | float = 0.0
    """Replay-to-replay distance of this rank's own probe (tolerant-mode calibration)."""
    failed: bool = False
    """The rank raised an error inside the step (every rank then stops; that rank re-raises it)."""

    WIDTH = 9
    """Columns of the encoded row."""

    def encode(self, device: torch.device | None = None) -> torch.Tensor:
        """The int64 row, on ``device`` (default: that of the first tensor field, else the CPU).

        Built with device kernels only: a tensor field is reinterpreted (floats) or converted in
        place on its device, a number is written by a fill, so nothing waits for the device.
        """
        fields: list[tuple[object, bool]] = [
            (self.local_norm, True),
            (self.reduced, False),
            (self.weights, False),
            (self.optimizer, False),
            (self.verified, False),
            (self.pair_distance, True),
            (self.noise, True),
            (self.loss, True),
            (self.failed, False),
        ]
        if device is None:
            device = next((v.device for v, _ in fields if isinstance(v, torch.Tensor)), torch.device("cpu"))
        if not any(isinstance(v, torch.Tensor) for v, _ in fields):
            return torch.tensor([_bits(v, is_float) for v, is_float in fields], dtype=torch.int64)
        return torch.stack([_cell(v, is_float, device) for v, is_float in fields])

    @classmethod
    def decode(cls, rows: torch.Tensor) -> list[HostRow]:
        """The rows of a ``(world, WIDTH)`` all-gather, indexed by rank."""
        if rows.dim() != 2 or rows.shape[1] != cls.WIDTH:
            raise WireFormatError(f"step rows must have shape (world, {cls.WIDTH}), got {tuple(rows.shape)}")
        return [
            StepRow(
                local_norm=bits_float(norm),
                reduced=reduced,
                weights=weights,
                optimizer=opt,
                verified=bool(verified),
                pair_distance=bits_float(pair),
                noise=bits_float(noise),
                loss=bits_float(loss),
                failed=bool(failed),
            )
            for norm, reduced, weights, opt, verified, pair, noise, loss, failed in rows.tolist()
        ]


def _bits(value: object, is_float: bool) -> int:
    """A number as it is stored in a row: a float's bits, or the integer."""
    if is_float:
        return float_bits(float(value))  # type: ignore[arg-type]  # the fields are numbers here
    return int(value)  # type: ignore[call-overload,no-any-return]


def _cell(value: object, is_float: bool, device: torch.device) -> torch.Tensor:
    """One cell of a row as a 0-dim int64 tensor on ``device``, without a host transfer."""
    if isinstance(value, torch.Tensor):
        v = value.detach().reshape(())
        if v.device.type == "cpu" and device.type != "cpu":
            value = v.item()  # a host value already: written by a fill, not copied up
        else:
            if v.device != device:
                v = v.to(device)  # between accelerators: a device-to-device copy
            return v.to(torch.float64).view(torch.int64) if is_float else v.to(torch.int64)
    return torch.full((), _bits(value, is_float), dtype=torch.int64, device=device)


HostRow = StepRow[float, int]
"""A decoded row: every field a plain number."""
