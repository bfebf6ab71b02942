"""The data that crosses ranks during a step, each with one encode and one decode.

* :class:`StepRow` — the int64 row every rank contributes to the step's single all-gather.
* :class:`ProbePayload` — a probe as its source sends it to its verifier.
* :class:`ArbitrationRequest` — a disputed probe and the verifier's replay, sent to an arbiter.
* :class:`GradientWork` — the passes of a step whose gradient alarmed, sent to a peer to re-run.
* :class:`UpdateRecord`, :class:`UpdateValues` — a rank's optimizer update of its shard, sent to
  its verifier and arbiter (plain FSDP2, :mod:`replicheck.guard.checks.update`).

Point-to-point messages travel through ``torch.save``/``torch.load(weights_only=True)``, so the
encoded forms are tagged tuples of tensors, numbers and strings (plus the user's batch pytree).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import torch

from replicheck.guard.errors import GuardError

_PROBE_TAG = "replicheck.probe/1"
_WORK_TAG = "replicheck.gradient-work/1"
_ARBITRATION_TAG = "replicheck.arbitration/1"


class WireFormatError(GuardError):
    """A message received from another rank does not have the expected shape."""


class PlacementError(GuardError):
    """A tensor is not on the device the guard's device rule puts it (an internal error)."""


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
    parameters (tolerant mode). Always on the host: a local result is brought there once
    (:func:`~replicheck.guard.transport.transfer.host_result`), a received one is decoded there,
    so a comparison never mixes devices."""

    def __post_init__(self) -> None:
        if self.fingerprint.device.type != "cpu":
            raise PlacementError(
                f"a probe result's fingerprint must be on the host, got one on {self.fingerprint.device}"
            )


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


@dataclass(frozen=True)
class BackwardPass:
    """One backward pass of a step as it ran, so the failure path can repeat it."""

    batch: Any
    """The samples of the pass."""
    weight: float
    """Its share of the step's loss."""
    seed: int | None
    """The probe seed it ran under, or ``None`` for a training pass (unseeded)."""


@dataclass(frozen=True)
class GradientWork:
    """A rank's passes of a step whose gradient alarmed, sent to a healthy peer on another node
    that re-runs them (the same bad gradient there: the data, not the device)."""

    passes: tuple[BackwardPass, ...]
    """The passes as they ran on the sending rank."""

    def encode(self) -> tuple[object, ...]:
        return (_WORK_TAG, [(p.batch, p.weight, p.seed) for p in self.passes])

    @classmethod
    def decode(cls, wire: object) -> GradientWork:
        if not (isinstance(wire, tuple) and len(wire) == 2 and wire[0] == _WORK_TAG):
            raise WireFormatError(f"not a step's gradient work: {type(wire).__name__}")
        passes = []
        for p in _seq(wire[1]):
            batch, weight, seed = _seq(p)
            if not isinstance(weight, (int, float)) or not (seed is None or isinstance(seed, int)):
                raise WireFormatError("a pass of gradient work must be (batch, weight, seed)")
            passes.append(BackwardPass(batch=batch, weight=float(weight), seed=seed))
        return cls(passes=tuple(passes))


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
    precision: int = 0
    """Tolerant mode, on a verification step: the code of the precision the rank's tolerances are
    for (:func:`replicheck.guard.tolerance.code`; 0 otherwise)."""

    WIDTH = 10
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
            (self.precision, False),
        ]
        if device is None:
            device = next((v.device for v, _ in fields if isinstance(v, torch.Tensor)), torch.device("cpu"))
        if not any(isinstance(v, torch.Tensor) for v, _ in fields):
            return torch.tensor([_bits(v, is_float) for v, is_float in fields], dtype=torch.int64)
        return torch.stack([_cell(v, is_float, device) for v, is_float in fields])

    @classmethod
    def decode(cls, rows: torch.Tensor) -> Rows:
        """The rows of a ``(world, WIDTH)`` all-gather, indexed by rank (decoded on demand)."""
        if rows.dim() != 2 or rows.shape[1] != cls.WIDTH:
            raise WireFormatError(f"step rows must have shape (world, {cls.WIDTH}), got {tuple(rows.shape)}")
        return Rows(rows)


_COLUMNS: tuple[str, ...] = (
    *("local_norm", "reduced", "weights", "optimizer", "verified"),
    *("pair_distance", "noise", "loss", "failed", "precision"),
)
"""The encoded row's fields in column order (:meth:`StepRow.encode`)."""
_FLOAT_COLUMNS = frozenset({"local_norm", "pair_distance", "noise", "loss"})
_BOOL_COLUMNS = frozenset({"verified", "failed"})


class Rows(Sequence["HostRow"]):
    """Every rank's row of a step, as the all-gather left them (a CPU int64 ``(world, WIDTH)``
    tensor). A row is decoded when it is asked for; :meth:`column` reads one field of every
    rank with tensor operations, so a clean step's checks cost no Python object per rank (at
    16,384 ranks decoding every row took ~100 ms a step)."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table.to(torch.int64).contiguous()

    def __len__(self) -> int:
        return int(self._table.shape[0])

    @overload
    def __getitem__(self, index: int) -> HostRow: ...

    @overload
    def __getitem__(self, index: slice) -> list[HostRow]: ...

    def __getitem__(self, index: int | slice) -> HostRow | list[HostRow]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        norm, reduced, weights, opt, verified, pair, noise, loss, failed, precision = self._table[
            index
        ].tolist()
        return StepRow(
            local_norm=bits_float(norm),
            reduced=reduced,
            weights=weights,
            optimizer=opt,
            verified=bool(verified),
            pair_distance=bits_float(pair),
            noise=bits_float(noise),
            loss=bits_float(loss),
            failed=bool(failed),
            precision=precision,
        )

    def column(self, name: str) -> list[Any]:
        """Field ``name`` of every rank's row, indexed by rank, as plain numbers."""
        if name not in _COLUMNS:
            raise KeyError(f"no step-row field {name!r}")
        col = self._table[:, _COLUMNS.index(name)].contiguous()
        if name in _FLOAT_COLUMNS:
            return col.view(torch.float64).tolist()
        if name in _BOOL_COLUMNS:
            return (col != 0).tolist()
        return col.tolist()


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


ParamState = dict[str, object]
"""One parameter's shard in an update record: its optimizer state (tensors and numbers) and
``value`` (plus ``grad`` before the step); an optimizer's own state is a dict by nature."""
DigestEntry = tuple[int, str, object]
"""``(parameter index, state key, digest or plain value)`` of one new value."""

_UPDATE_TAG = "replicheck.update/1"
_VALUES_TAG = "replicheck.update-values/1"


@dataclass(frozen=True)
class ShardState:
    """This rank's shard of every parameter, gradient and optimizer state tensor, copied."""

    groups: tuple[dict[str, object], ...]
    """Each parameter group's hyperparameters (without its parameters)."""
    sizes: tuple[int, ...]
    """Parameters in each group."""
    params: tuple[ParamState, ...]
    """Every parameter's shard, in the optimizer's order."""


@dataclass(frozen=True)
class UpdateRecord:
    """A rank's optimizer update of its shard, as its verifier (or an arbiter) replays it."""

    before: ShardState | None
    """The shard as the step began; ``None`` when the optimizer did not step (nothing to check)."""
    digests: tuple[DigestEntry, ...] | None = None
    """Digests of the new values (sent first: a bit-identical replay ends the check there)."""
    after: tuple[ParamState, ...] | None = None
    """The new values themselves (sent to an arbiter, or when the digests differ)."""

    def encode(self) -> tuple[object, ...]:
        b = self.before
        return (
            _UPDATE_TAG,
            None if b is None else (list(b.groups), list(b.sizes), _host_scalars_out(b.params)),
            None if self.digests is None else [list(d) for d in self.digests],
            None if self.after is None else _host_scalars_out(self.after),
        )

    @classmethod
    def decode(cls, wire: object) -> UpdateRecord:
        if not (isinstance(wire, tuple) and len(wire) == 4 and wire[0] == _UPDATE_TAG):
            raise WireFormatError(f"not an update record: {type(wire).__name__}")
        _, before, digests, after = wire
        state = None
        if before is not None:
            if not (isinstance(before, (tuple, list)) and len(before) == 3):
                raise WireFormatError("update record with a malformed shard")
            groups, sizes, params = before
            state = ShardState(
                groups=tuple(_mapping(g) for g in _seq(groups)),
                sizes=tuple(_int(n) for n in _seq(sizes)),
                params=tuple(_host_scalars_in(_mapping(p)) for p in _seq(params)),
            )
        return cls(
            before=state,
            digests=None if digests is None else tuple(_digest_entry(d) for d in _seq(digests)),
            after=None if after is None else tuple(_host_scalars_in(_mapping(p)) for p in _seq(after)),
        )


@dataclass(frozen=True)
class UpdateValues:
    """The new values of a rank's shard, sent when its verifier's replay is not bit-identical."""

    values: tuple[ParamState, ...]

    def encode(self) -> tuple[object, ...]:
        return (_VALUES_TAG, _host_scalars_out(self.values))

    @classmethod
    def decode(cls, wire: object) -> UpdateValues:
        if not (isinstance(wire, tuple) and len(wire) == 2 and wire[0] == _VALUES_TAG):
            raise WireFormatError(f"not update values: {type(wire).__name__}")
        return cls(values=tuple(_host_scalars_in(_mapping(p)) for p in _seq(wire[1])))


_HOST_SCALAR_TAG = "replicheck.host-scalar/1"


def _host_scalars_out(params: Sequence[ParamState]) -> list[ParamState]:
    """``params`` with every 0-dim host tensor (an optimizer's step counter, kept on the host
    beside device state) written as a number in the message's header.

    A host tensor among device tensors would make the message be packed on the host (one
    blocking copy per state tensor) and copied back to the device for the send; as a number it
    rides in the header and the tensors are packed on their device.
    """
    return [
        {
            k: (_HOST_SCALAR_TAG, str(v.dtype).removeprefix("torch."), v.item())
            if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0
            else v
            for k, v in st.items()
        }
        for st in params
    ]


def _host_scalars_in(state: ParamState) -> ParamState:
    """Inverse of :func:`_host_scalars_out` for one parameter: host scalars as host tensors."""
    out: ParamState = {}
    for k, v in state.items():
        if isinstance(v, (tuple, list)) and len(v) == 3 and v[0] == _HOST_SCALAR_TAG:
            dtype = getattr(torch, str(v[1]), None)
            if not isinstance(dtype, torch.dtype) or not isinstance(v[2], (int, float, bool)):
                raise WireFormatError(f"a malformed host scalar in an update record: {v!r}")
            out[k] = torch.tensor(v[2], dtype=dtype)
        else:
            out[k] = v
    return out


def _seq(x: object) -> Sequence[object]:
    if not isinstance(x, (list, tuple)):
        raise WireFormatError(f"expected a sequence in an update record, got {type(x).__name__}")
    return x


def _int(x: object) -> int:
    if not isinstance(x, int):
        raise WireFormatError(f"expected an integer in an update record, got {type(x).__name__}")
    return x


def _mapping(x: object) -> dict[str, object]:
    if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
        raise WireFormatError(f"expected a mapping in an update record, got {type(x).__name__}")
    return dict(x)


def _digest_entry(x: object) -> DigestEntry:
    entry = _seq(x)
    if len(entry) != 3:
        raise WireFormatError("a digest entry must be (index, key, value)")
    index, key, value = entry
    if not isinstance(index, int) or not isinstance(key, str):
        raise WireFormatError("a digest entry must be (index, key, value)")
    return (index, key, value)
