"""The guard's wire formats and its failure-path helpers, without a process group."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from replicheck import fingerprint as fp
from replicheck.guard.checks.replicas import gradient_finding
from replicheck.guard.transport.batch import pack, unpack
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import (
    ArbitrationRequest,
    BackwardPass,
    GradientWork,
    ProbePayload,
    ProbeResult,
    StepRow,
    WireFormatError,
)

pytestmark = pytest.mark.timeout(60)


def _payload() -> ProbePayload:
    batch = {"tokens": torch.arange(6).reshape(2, 3)}
    return ProbePayload(
        step=7,
        source=1,
        batch=batch,
        weight=0.25,
        seed=12345,
        size=2,
        result=ProbeResult(loss=1.5, fingerprint=torch.tensor([3, -4], dtype=torch.int64)),
    )


def test_probe_payload_survives_the_point_to_point_serialisation() -> None:
    """A probe payload encoded, packed, unpacked (weights_only) and decoded equals the original."""
    sent = _payload()
    got = ArbitrationRequest.decode(
        unpack(pack(ArbitrationRequest(payload=sent, verifier_result=sent.result).encode()))
    ).payload
    assert (got.step, got.source, got.weight, got.seed, got.size) == (7, 1, 0.25, 12345, 2)
    assert torch.equal(got.batch["tokens"], sent.batch["tokens"])
    assert got.result.loss == 1.5 and torch.equal(got.result.fingerprint, sent.result.fingerprint)


@pytest.mark.parametrize(
    "wire", [None, {"step": 1}, ("replicheck.probe/1", 1, 2), ("other", 1, 2, 3, 4, 5, 6, 7, 8)]
)
def test_malformed_probe_payload_raises_typed_error(wire: object) -> None:
    """Anything that is not an encoded probe payload raises WireFormatError, not a KeyError."""
    with pytest.raises(WireFormatError):
        ProbePayload.decode(wire)


def test_gradient_work_survives_the_point_to_point_serialisation() -> None:
    """A step's passes sent to a peer for a re-run come back as typed passes (batch, weight, seed);
    anything else raises WireFormatError."""
    sent = GradientWork(
        passes=(
            BackwardPass(batch=_payload().batch, weight=0.25, seed=12345),
            BackwardPass(batch={"tokens": torch.ones(1, 3)}, weight=0.75, seed=None),
        )
    )
    got = GradientWork.decode(unpack(pack(sent.encode())))
    assert [(p.weight, p.seed) for p in got.passes] == [(0.25, 12345), (0.75, None)]
    assert torch.equal(got.passes[0].batch["tokens"], sent.passes[0].batch["tokens"])
    for wire in (None, [], ("replicheck.gradient-work/1", [(1, "w", None)])):
        with pytest.raises(WireFormatError):
            GradientWork.decode(wire)


def test_step_row_round_trips_every_column_bit_for_bit() -> None:
    """A step row keeps floats (NaN, -0.0, inf included) and int64 digests exactly through its row."""
    row = StepRow(
        loss=-0.0,
        local_norm=math.inf,
        reduced=-(1 << 63),
        weights=(1 << 63) - 1,
        optimizer=5,
        verified=True,
        pair_distance=float("nan"),
        noise=1e-300,
    )
    (back,) = StepRow.decode(torch.stack([row.encode()]))
    assert math.copysign(1.0, back.loss) == -1.0 and back.local_norm == math.inf
    assert (back.reduced, back.weights, back.optimizer, back.verified) == (-(1 << 63), (1 << 63) - 1, 5, True)
    assert math.isnan(back.pair_distance) and back.noise == 1e-300


def test_gradient_finding_classifies_from_the_rerun_callable() -> None:
    """With world size 1 the gradient finding runs on a plain Comm: a clean re-run means transient."""
    comm = Comm()
    transient = gradient_finding(comm, [0], [math.nan], 1e9, rerun_norm=lambda: 2.0)
    persistent = gradient_finding(comm, [0], [math.nan], 1e9, rerun_norm=lambda: math.inf)
    assert (transient.suspects, transient.classification) == ((0,), "transient")
    assert persistent.classification == "persistent"
    assert transient.evidence["reruns"] == [{"rank": 0, "rerun_norm": 2.0, "classification": "transient"}]


def test_live_and_saved_optimizer_state_digest_alike() -> None:
    """The optimizer digest of a live optimizer equals the digest of its state_dict's state."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert fp.optimizer_digest(opt) == fp.optimizer_digest(opt.state_dict()["state"])
    model.weight.requires_grad_(False)
    assert fp.model_digest(model, "all") != fp.model_digest(model, "trainable")


class Pair(NamedTuple):
    a: torch.Tensor
    b: str


def test_packed_tensors_of_every_dtype_and_layout_come_back_equal() -> None:
    """Tensors of mixed dtypes (bool, bfloat16, int64, complex), 0-dim, empty and non-contiguous
    ones, inside dicts, lists and named tuples, come back equal in dtype, shape and bits."""
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    sent = {
        "t": base.t(),  # non-contiguous
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(5).to(torch.bfloat16),
        "ids": [torch.tensor(7), torch.empty(0, 3, dtype=torch.int64)],
        "z": Pair(a=torch.randn(3, dtype=torch.complex64), b="text"),
        "n": 3.5,
    }
    got = unpack(pack(sent))
    assert got["n"] == 3.5 and got["z"].b == "text" and isinstance(got["z"], Pair)
    for a, b in [
        (sent["t"], got["t"]),
        (sent["flags"], got["flags"]),
        (sent["half"], got["half"]),
        (sent["ids"][0], got["ids"][0]),
        (sent["ids"][1], got["ids"][1]),
        (sent["z"].a, got["z"].a),
    ]:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_truncated_packed_message_raises_typed_error() -> None:
    """A message cut short (its header claims more bytes than arrived) raises BatchError."""
    from replicheck.guard.errors import BatchError

    data = pack({"x": torch.ones(3)})
    with pytest.raises(BatchError):
        unpack(data[:12])


def test_step_rows_decode_on_demand_and_columns_match_the_rows() -> None:
    """StepRow.decode keeps the all-gather's table: a row decoded by index (negative too, or a
    slice) and a whole column read with tensor operations give the same values, NaN, inf and
    negative floats included; an unknown field is a KeyError."""
    made = [
        StepRow(
            loss=float(i) - 2.5,
            local_norm=[0.5, math.nan, math.inf, -0.0][i],
            reduced=-(7**i),
            verified=i % 2 == 0,
        )
        for i in range(4)
    ]
    rows = StepRow.decode(torch.stack([r.encode() for r in made]))
    assert len(rows) == 4 and repr(rows[-1]) == repr(rows[3])
    assert [repr(r) for r in rows[1:3]] == [repr(rows[1]), repr(rows[2])]
    for field in ("loss", "local_norm", "reduced", "verified", "failed", "precision", "pair_distance"):
        by_row = [getattr(r, field) for r in rows]
        assert [repr(v) for v in rows.column(field)] == [repr(v) for v in by_row], field
    assert rows.column("reduced") == [r.reduced for r in made]
    with pytest.raises(KeyError):
        rows.column("nonsense")
