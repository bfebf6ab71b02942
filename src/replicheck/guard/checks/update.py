"""Plain FSDP2: each rank's optimizer update of its shard, replayed by its ring verifier.

Under plain FSDP2 one rank alone holds each shard of the weights and of the optimizer state, so
no replica can vote on an update. On a verification step the guard instead records, as the
optimizer's step begins, this rank's shard of every parameter, its gradient and its optimizer
state, and after the step the new values; the record goes to the rank's verifier (on another
node, as for the probe replay), which builds an optimizer of the same class with the same
hyperparameters over plain copies of the shard, steps it, and compares. The comparison allows a
thousandth of each value's update plus a few units of rounding, so the kernels need not be
bit-identical; a corrupted update of one value (a flipped high mantissa or exponent bit of the
step's delta) is far outside it.

A disagreement is arbitrated by a third rank replaying the same record (the one the evidence
contradicts is named) and classified by the named rank doing its part again: the same wrong
answer twice is ``persistent``. Every rank then restores the state it had before the step, so
the corrupted update is not applied. With two ranks there is no arbiter: ``ambiguous``.

Only optimizers whose update of a value reads that value's own state and gradient alone are
replayed (``REPLAYABLE``): one that reads whole tensors (a norm, a matrix factor) would compute
something else over a shard. This costs, on verification steps, one copy of the shard's
parameters, gradients and optimizer state before the step (the record), the transfer of it to
the verifier, and the verifier's optimizer step on it. The new values are read in place, not
copied; the replay steps the record a part (about an eighth) at a time, so the check holds no
second copy of the shard; the record is packed on the shard's device (host step counters ride
in its header as numbers), and one device→host copy (the digests) is made per record.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import Evidence, Finding
from replicheck.guard.errors import GuardError, UpdateReplayError
from replicheck.guard.gate import step_gate
from replicheck.guard.shards import local
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import (
    DigestEntry,
    ParamState,
    ShardState,
    UpdateRecord,
    UpdateValues,
)
from replicheck.guard.transport.transfer import to_host

log = logging.getLogger(__name__)

REPLAYABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""Optimizers updating each value from its own state and gradient only (exact classes)."""

_REL = 1e-3
"""Allowed difference, as a fraction of the value's update in the replay."""
_ULPS = 4.0
"""Allowed difference, in units of rounding of the value itself."""

Values = Sequence[ParamState]
"""Every parameter's values (state entries and ``value``), in the optimizer's order."""


def replayable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :class:`UpdateReplay` can replay ``optimizer``'s updates shard by shard."""
    return type(optimizer) in REPLAYABLE


class UpdateReplay:
    """Records this rank's update on armed steps and runs the ring's check of it (collective)."""

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Comm, ring: Ring) -> None:
        self._optimizer, self._comm, self._ring = optimizer, comm, ring
        self._armed = False
        self._before: ShardState | None = None
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def arm(self) -> None:
        """Record the next optimizer step (it runs only when the scaler does not skip it).

        The recording pre-hook is registered here, anew, so it is the optimizer's last pre-hook:
        a user's pre-hook (clipping, any edit of the gradient) registered after the guard runs
        before the record is taken, and the replay starts from the gradient the step applies.
        """
        self._armed, self._before = True, None
        if self._handle is not None:
            self._handle.remove()
        self._handle = self._optimizer.register_step_pre_hook(self._pre)

    def _pre(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._armed:
            self._armed = False
            self._before = snapshot(optimizer)

    def check(self, step: int) -> Finding | None:
        """Collective: send this rank's record to its verifier, replay its source's, and resolve
        any disagreement. ``None`` when every update replayed within tolerance.

        First the record travels with only a digest of the new values: a bit-identical replay
        (the same kernels on the same kind of device) ends the check there. Only pairs whose
        bits differ send the new values themselves, to be compared within tolerance.
        """
        self._armed = False
        before = self._before
        # The new values are read in place (not copied) until the step is undone or kept.
        after = None if before is None else live(self._optimizer)
        record = UpdateRecord(before=before, after=after)
        me, ring = self._comm.rank, self._ring
        verifier, source = ring.verifier_of(me), ring.source_of(me)
        light = UpdateRecord(before=before, digests=None if after is None else digests(after))
        got = UpdateRecord.decode(self._comm.exchange([(verifier, light.encode())], [source])[source])
        replayed, failure = self._replay_digests(got)
        same = failure is None and (replayed is None or replayed == got.digests)
        # Verifiers whose replay is not bit-identical: one constant-size collective when all are.
        pending = self._comm.flagged(not same, "update replays")
        if not pending:
            self._before = None  # the copy of the shard is not kept between verifications
            return None
        sends = [(verifier, UpdateValues(values=after or ()).encode())] if verifier in pending else []
        inbox = self._comm.exchange(sends, [source] if me in pending else [])
        mine: tuple[float, str] = (0.0, "")
        if me in pending:
            values = UpdateValues.decode(inbox[source]).values
            got = UpdateRecord(before=got.before, after=values)
            mine = (math.inf, failure or "") if replayed is None else judge(self._optimizer, got)
        outcomes = self._comm.gather_objects(mine)
        failing = [(ring.source_of(v), v) for v, (ratio, _) in enumerate(outcomes) if not ratio <= 1.0]
        if len(failing) == ring.world_size >= 3:
            # One bad device fails at most its two pairs: every pair failing is the software.
            raise UpdateReplayError(
                f"step {step}: every rank's optimizer update differs from its replay on another rank "
                f"(worst: {outcomes[failing[0][1]][1]}). The optimizer does not compute what a fresh "
                f"{type(self._optimizer).__name__} with the same hyperparameters computes: an "
                "optimizer step hook that changes parameters (EMA, clamping), or a subclass "
                "that changes the update. No node is blamed; this step's update was undone. "
                "Remove the hook or set GuardConfig(replay_update=False)."
            )
        if not failing:
            log.info(
                "step %d: update replays within tolerance (not bit-identical on ranks %s)", step, pending
            )
            self._before = None
            return None
        return self._resolve(step, failing, outcomes, record, got)

    def _replay_digests(self, record: UpdateRecord) -> tuple[tuple[DigestEntry, ...] | None, str | None]:
        """Digests of this rank's replay of a source's record, or why it could not run."""
        if record.before is None:
            return None, None
        try:
            parts = _replay(type(self._optimizer), record.before, _device(self._optimizer))
            return _digests_of_parts(parts), None
        except Exception as exc:  # noqa: BLE001 - a replay that cannot run is a failed check, recorded
            log.warning("the update replay failed: %s", exc)
            return None, f"replay failed: {type(exc).__name__}: {exc}"

    def restore(self) -> None:
        """Put back the parameters and optimizer state this rank had before the recorded step."""
        if self._before is not None:
            _restore(self._optimizer, self._before)
            self._before = None

    # -- a disagreement -------------------------------------------------------------------------
    def _resolve(
        self,
        step: int,
        failing: list[tuple[int, int]],
        outcomes: list[tuple[float, str]],
        record: UpdateRecord,
        received: UpdateRecord,
    ) -> Finding:
        me, ring = self._comm.rank, self._ring
        arbiters = {src: ring.arbiter_for(src, ver) for src, ver in failing}
        sends = [(a, record.encode()) for src, a in arbiters.items() if src == me and a is not None]
        inbox = self._comm.exchange(sends, [s for s, a in sorted(arbiters.items()) if a == me])
        verdicts = {src: judge(self._optimizer, UpdateRecord.decode(rec))[0] for src, rec in inbox.items()}
        arbitration: dict[int, float] = {}
        for ruled in self._comm.gather_objects(verdicts):
            arbitration.update(ruled)
        named = {
            src: (src if arbitration[src] > 1.0 else ver)
            for src, ver in failing
            if arbiters[src] is not None and src in arbitration and math.isfinite(arbitration[src])
        }
        # The named rank does its part again: the real update from the same state, or the replay.
        again: dict[int, bool] = {}
        for src, ver in failing:
            if named.get(src) == me == src:
                again[src] = self._rerun_matches(record)
            elif named.get(src) == me == ver:
                again[src] = judge(self._optimizer, received)[0] > 1.0
        repeats: dict[int, bool] = {}
        for got in self._comm.gather_objects(again):
            repeats.update(got)
        pairs: list[Evidence] = [
            {
                "source": src,
                "verifier": ver,
                "ratio": outcomes[ver][0],
                "where": outcomes[ver][1],
                "arbiter": arbiters[src],
                "arbiter_ratio": arbitration.get(src),
            }
            for src, ver in failing
        ]
        evidence: Evidence = {"pairs": pairs, "tolerance": {"relative_to_update": _REL, "ulps": _ULPS}}
        suspects = sorted(set(named.values()))
        if not suspects:
            evidence["note"] = "no third rank could replay the update: the pair cannot be told apart"
            return Finding(
                check="optimizer_update",
                candidates=tuple(sorted({r for p in failing for r in p})),
                evidence=evidence,
            )
        persistent = all(repeats.get(src, False) for src in named)
        evidence["note"] = (
            "a third rank's replay of the disputed update sided with one party; the named rank then "
            "did its part again" + (" and gave the same wrong answer" if persistent else "")
        )
        unresolved = sorted({r for src, ver in failing if src not in named for r in (src, ver)})
        return Finding(
            check="optimizer_update",
            suspects=tuple(suspects),
            candidates=tuple(unresolved),
            classification="persistent" if persistent else "transient",
            evidence=evidence,
        )

    def _rerun_matches(self, record: UpdateRecord) -> bool:
        """Run this rank's real optimizer step again from the recorded state: whether it gives
        the same (disputed) values as the first time. Leaves the state as before the step."""
        if self._before is None or record.before is None or record.after is None:
            return False
        # The record's new values may be this rank's live state, which the restore overwrites.
        first = [{k: _copy(v) for k, v in st.items()} for st in record.after]
        _restore(self._optimizer, self._before)
        self._armed = False
        _step_ungated(self._optimizer)
        second = live(self._optimizer)
        ratio, _ = _compare(first, second, record.before.params)
        _restore(self._optimizer, self._before)
        return ratio <= 1.0


def _step_ungated(optimizer: torch.optim.Optimizer) -> None:
    gate = step_gate(optimizer)
    gate.open = True
    try:
        optimizer.step()
    finally:
        gate.open = False


def snapshot(optimizer: torch.optim.Optimizer, *, grads: bool = True) -> ShardState:
    """This rank's shard of every parameter (``value``), gradient and state tensor, copied."""
    groups: list[dict[str, object]] = []
    state: list[ParamState] = []
    for g in optimizer.param_groups:
        groups.append({k: _copy(v) for k, v in g.items() if k != "params"})
        for p in g["params"]:
            st: ParamState = {
                k: _copy(local(v) if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state.get(p, {}).items()
            }
            st["value"] = local(p).detach().clone()
            if grads:
                st["grad"] = None if p.grad is None else local(p.grad).detach().clone()
            state.append(st)
    return ShardState(
        groups=tuple(groups),
        sizes=tuple(len(g["params"]) for g in optimizer.param_groups),
        params=tuple(state),
    )


def live(optimizer: torch.optim.Optimizer) -> tuple[ParamState, ...]:
    """This rank's shard of every parameter (``value``) and state value as they are now: the
    optimizer's own tensors, not copies (valid until the state next changes)."""
    return tuple(
        {
            **{
                k: local(v) if isinstance(v, torch.Tensor) else v
                for k, v in optimizer.state.get(p, {}).items()
            },
            "value": local(p).detach(),
        }
        for g in optimizer.param_groups
        for p in g["params"]
    )


def _copy(v: object) -> object:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _tensor(v: object, what: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise GuardError(f"an update record's {what} is {type(v).__name__}, not a tensor")
    return v


def _restore(optimizer: torch.optim.Optimizer, before: ShardState) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for p, st in zip(params, before.params):
            local(p).copy_(_tensor(st["value"], "value"))
            kept = {k: v for k, v in st.items() if k not in ("value", "grad")}
            if not kept:
                optimizer.state.pop(p, None)
                continue
            live = optimizer.state.setdefault(p, {})
            for k in list(live):
                if k not in kept:
                    del live[k]
            for k, v in kept.items():
                cur = live.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                    local(cur).copy_(v)
                else:
                    live[k] = _copy(v)


_CHUNKS = 8
"""A replay steps the shard in about this many parts, so its working copy is a fraction of it."""


def _replay(
    cls: Callable[..., torch.optim.Optimizer], before: ShardState, device: torch.device
) -> Iterator[list[ParamState]]:
    """Step fresh optimizers of ``cls`` over plain copies of the recorded shard, a part at a
    time (consecutive parameters of one group, about ``1/_CHUNKS`` of the shard's bytes each):
    each part's new values in order, to be consumed (and dropped) before the next is made.

    The replayable optimizers update each value from its own state and gradient alone, so a part
    steps exactly as the whole would; the record is not modified (it may be this rank's own).
    """
    budget = max(1, sum(_nbytes(st) for st in before.params) // _CHUNKS)
    i = 0
    for hp, n in zip(before.groups, before.sizes):
        members = list(before.params[i : i + n])
        i += n
        part: list[ParamState] = []
        size = 0
        for k, st in enumerate(members):
            part.append(st)
            size += _nbytes(st)
            if size >= budget or k == len(members) - 1:
                yield _step_part(cls, hp, part, device)
                part, size = [], 0


def _step_part(
    cls: Callable[..., torch.optim.Optimizer],
    hp: dict[str, object],
    part: Sequence[ParamState],
    device: torch.device,
) -> list[ParamState]:
    params: list[torch.Tensor] = []
    for st in part:
        p = _fresh(_tensor(st["value"], "value"), device)
        grad = st["grad"]
        p.grad = None if grad is None else _fresh(_tensor(grad, "grad"), device)
        params.append(p)
    shadow = cls([{**hp, "params": params}])
    for p, st in zip(params, part):
        # Host scalars (step counters) stay on the host, where the optimizer keeps them.
        kept = {
            k: _fresh(v, v.device if _host_scalar(v) else device) if isinstance(v, torch.Tensor) else v
            for k, v in st.items()
            if k not in ("value", "grad")
        }
        if kept:
            shadow.state[p] = kept
    shadow.step()
    return [{**shadow.state.get(p, {}), "value": p.detach()} for p in params]


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` that nothing else refers to."""
    return t.detach().to(device, copy=True)


def _host_scalar(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def _nbytes(st: ParamState) -> int:
    return sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))


def judge(optimizer: torch.optim.Optimizer, record: UpdateRecord) -> tuple[float, str]:
    """The worst ratio of difference to tolerance between a source's recorded update (with its
    new values, ``after``) and its replay here (``0.0`` when the source's optimizer did not
    step), and where it was."""
    if record.before is None:
        return 0.0, ""
    if record.after is None:
        return math.inf, "no new values in the record"
    try:
        # Compared a part at a time as the replay produces it (no whole second shard).
        return _compare(
            _on(optimizer, record.after),
            (st for part in _replay(type(optimizer), record.before, _device(optimizer)) for st in part),
            _on(optimizer, record.before.params),
        )
    except Exception as exc:  # noqa: BLE001 - a replay that cannot run is a failed check, recorded
        log.warning("the update replay failed: %s", exc)
        return math.inf, f"replay failed: {type(exc).__name__}: {exc}"


def _device(optimizer: torch.optim.Optimizer) -> torch.device:
    return next((local(p).device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))


def _on(optimizer: torch.optim.Optimizer, values: Values) -> list[ParamState]:
    """``values`` on the optimizer's device, host scalars (step counters) left on the host."""
    device = _device(optimizer)
    return [
        {k: v.to(device) if isinstance(v, torch.Tensor) and not _host_scalar(v) else v for k, v in st.items()}
        for st in values
    ]


def digests(state: Values) -> tuple[DigestEntry, ...]:
    """Exact digests of every new value (tensors; other values as they are), one host transfer."""
    return _digests_of_parts([state])


def _digests_of_parts(parts: Iterable[Values]) -> tuple[DigestEntry, ...]:
    """:func:`digests` of the parameters of ``parts`` in order; each part is digested on its
    device as it comes (and may then be dropped), and the digests cross to the host together.
    A host scalar (a step counter) is its own digest: its value, read where it already is."""
    entries: list[tuple[int, str, object]] = []
    codes: list[torch.Tensor] = []
    n = i = 0
    for part in parts:
        tensors: list[torch.Tensor] = []
        for st in part:
            for k in sorted(st):
                if k == "grad":
                    continue
                v = st[k]
                if isinstance(v, torch.Tensor) and _host_scalar(v):
                    v = v.item()
                if isinstance(v, torch.Tensor):
                    tensors.append(v)
                    entries.append((i, k, _Code(n)))
                    n += 1
                else:
                    entries.append((i, k, v))
            i += 1
        if tensors:
            codes.append(fp.digests(tensors))
    host = to_host(torch.cat(codes), "update digests").tolist() if codes else []
    return tuple((i, k, host[v.index] if isinstance(v, _Code) else v) for i, k, v in entries)


class _Code:
    """The place of a tensor's digest among a record's digests, while they are computed."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _compare(claimed: Values, replayed: Iterable[ParamState], before: Values) -> tuple[float, str]:
    worst, where = 0.0, ""
    for i, (c, r, b) in enumerate(zip(claimed, replayed, before)):
        for k, want in r.items():
            got = c.get(k)
            if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
                ratio = _ratio(got, want, b.get(k))
            else:
                ratio = 0.0 if got == want else math.inf
            if not ratio <= worst:
                worst, where = ratio, f"parameter {i} {k}"
    return worst, where


def _ratio(got: torch.Tensor, want: torch.Tensor, prior: object) -> float:
    """max |got - want| / (_REL · |want - prior| + _ULPS · eps · |want|) over the tensor."""
    if got.shape != want.shape:
        return math.inf
    g, w = got.double(), want.double()
    # A state value created by this step (no prior) may move by all of itself.
    start = prior.double() if isinstance(prior, torch.Tensor) and prior.shape == want.shape else 0.0
    moved = (w - start).abs()
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    allowed = _REL * moved + _ULPS * eps * w.abs() + torch.finfo(torch.float64).tiny
    diff = (g - w).abs()
    same_nan = g.isnan() & w.isnan()
    r = torch.where(same_nan, 0.0, diff / allowed)
    return float(r.max()) if r.numel() else 0.0
