"""The public fault injector: one rank behaves like faulty hardware, nothing else changes.

A :class:`Fault` is a frozen, picklable description built by chaining small calls::

    fault = (Fault.at_forward("blocks.0.ffn")      # where
             .persistent(from_step=23)              # when
             .bitflip(bit=22)                       # what
             .on_rank(1).seeded(7))
    handle = fault.install(model, optimizer=opt, guard=guard)   # on every rank; acts on rank 1
    # train as usual
    handle.records        # every corruption made: step, pass, tensor, positions, old/new values
    handle.remove()

``install`` is a no-op (an inert handle) on ranks other than the chosen one, so the same code
runs everywhere.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from replicheck.faults.errors import FaultConfigError
from replicheck.faults.patterns import (
    BitField,
    BitFlip,
    NonFinite,
    Pattern,
    Scale,
    SdcMix,
    ZeroChunk,
)
from replicheck.faults.schedule import (
    Intermittent,
    Persistent,
    Schedule,
    Transient,
    Trigger,
)
from replicheck.faults.sites import (
    Forward,
    OptimizerUpdate,
    ReducedGradient,
    Remover,
    Site,
    Targets,
    WeightGradient,
    WeightsAtRest,
    check_names,
    context,
)
from replicheck.guard.context import PassName
from replicheck.guard.modules import unwrap

PASSES: tuple[PassName, ...] = ("train", "probe", "replay", "optimizer", "rebuild", "idle", "selftest")


@dataclass(frozen=True)
class Corruption:
    """One corruption the injector made."""

    rank: int
    """Rank it happened on."""
    step: int
    """Guard step (``-1`` outside a guarded step)."""
    pass_: PassName
    """Guard pass: ``train``, ``probe``, ``replay``, ``optimizer``, ``idle``..."""
    site: str
    """The fault's site, described."""
    tensor: str
    """Which tensor: module output, op, parameter gradient, update, bucket..."""
    kind: str
    """Pattern that acted (``bitflip``, ``zero_chunk``, ``scale``, ``nan``, ``inf``...)."""
    positions: tuple[int, ...]
    """Flat indices changed."""
    old: tuple[float, ...]
    """Values before."""
    new: tuple[float, ...]
    """Values after."""
    bit: int | None = None
    """Bit flipped, for bit flips."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        d["old"] = [_num(v) for v in self.old]
        d["new"] = [_num(v) for v in self.new]
        d["positions"] = list(self.positions)
        return d


def _num(v: float) -> float | str:
    return v if v == v and v not in (float("inf"), float("-inf")) else str(v)


class FaultHandle:
    """An installed fault: its records, and :meth:`remove` (also a context manager)."""

    def __init__(self, fault: Fault, rank: int, active: bool) -> None:
        self.fault = fault
        self.rank = rank
        self.active = active
        self.records: list[Corruption] = []
        """Every corruption made so far, in order (a plain list: picklable, shareable)."""
        self._removers: list[Remover] = []
        self._trigger = Trigger(fault.when, seed=fault.seed * 2 + 1)
        self._gen = torch.Generator().manual_seed(fault.seed * 2)
        self._site = fault.where.describe() if fault.where is not None else ""

    def offer(
        self, tensor: torch.Tensor, name: str, *, step: int | None = None, pass_: PassName | None = None
    ) -> None:
        """Called by a site for each event: corrupt ``tensor`` in place if the fault acts now."""
        if not self.active:
            return
        now_step, now_pass = context()
        step = now_step if step is None else step
        pass_ = now_pass if pass_ is None else pass_
        if self.fault.passes is not None and pass_ not in self.fault.passes:
            return
        if not self._trigger.fires(step):
            return
        change = self.fault.what.apply(tensor, self._generator(name, tensor))
        self.records.append(
            Corruption(
                rank=self.rank,
                step=step,
                pass_=pass_,
                site=self._site,
                tensor=name,
                kind=change.kind,
                positions=change.positions,
                old=change.old,
                new=change.new,
                bit=change.bit,
            )
        )

    def _generator(self, name: str, tensor: torch.Tensor) -> torch.Generator:
        """Random choices (positions, bits, mix draws) for one corruption.

        A persistent fault is a broken unit: recomputing the same tensor gives the same wrong
        answer, so its choices are fixed per tensor (seed, name, size). One-shot and intermittent
        faults draw from one seeded stream.
        """
        if not isinstance(self.fault.when, Persistent):
            return self._gen
        key = zlib.crc32(f"{self.fault.seed}:{name}:{tensor.numel()}".encode())
        return torch.Generator().manual_seed(key)

    def remove(self) -> None:
        """Uninstall every hook; records are kept."""
        self.active = False
        while self._removers:
            self._removers.pop()()

    def __enter__(self) -> FaultHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Where, when and what a simulated hardware fault corrupts, and on which rank."""

    where: Site | None = None
    """The hardware path hit (set with ``at_*``)."""
    when: Schedule = field(default_factory=Persistent)
    """When it acts (default: persistent from step 0)."""
    what: Pattern = field(default_factory=lambda: BitFlip(field="mantissa"))
    """What it does to a value (default: flip a random mantissa bit)."""
    rank: int | None = None
    """The faulty rank (``.on_rank(R)``); ``None`` needs ``all_ranks`` in a multi-rank job."""
    all_ranks: bool = False
    """Act on every rank that installs it (``.on_all_ranks()``): an explicit choice, because a
    fault on every rank is no longer one bad device."""
    seed: int = 0
    """Seed of positions, bits and intermittent draws."""
    passes: tuple[PassName, ...] | None = None
    """Guard passes it may hit (``None``: all — a faulty unit corrupts whatever it computes)."""

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank < 0:
            raise FaultConfigError(f"rank must be >= 0, got {self.rank}")
        if self.passes is not None:
            unknown = set(self.passes) - set(PASSES)
            if unknown:
                raise FaultConfigError(f"unknown passes {sorted(unknown)}; known: {PASSES}")

    # -- where ------------------------------------------------------------------------------
    @classmethod
    def at_forward(cls, module: str, ops: Literal["output", "matmul"] | tuple[str, ...] = "output") -> Fault:
        """A forward activation: a module's output, or its matmuls (``ops="matmul"``)."""
        return cls(where=Forward(module=module, ops=ops))

    @classmethod
    def at_weight_gradient(cls, param: str) -> Fault:
        """The gradient of ``param`` only (forward untouched)."""
        return cls(where=WeightGradient(param=param))

    @classmethod
    def at_optimizer_update(cls, param: str) -> Fault:
        """The update the optimizer applies to ``param``."""
        return cls(where=OptimizerUpdate(param=param))

    @classmethod
    def at_weights(cls, param: str) -> Fault:
        """``param``'s stored values, between steps."""
        return cls(where=WeightsAtRest(param=param))

    @classmethod
    def at_reduced_gradient(cls, bucket: int | None = None) -> Fault:
        """The gradient after the all-reduce, on this rank."""
        return cls(where=ReducedGradient(bucket=bucket))

    def at(self, site: Site) -> Fault:
        """Any site."""
        return dataclasses.replace(self, where=site)

    # -- when -------------------------------------------------------------------------------
    def persistent(self, from_step: int = 0) -> Fault:
        return dataclasses.replace(self, when=Persistent(start=from_step))

    def transient(self, step: int, events: int = 1) -> Fault:
        return dataclasses.replace(self, when=Transient(step=step, events=events))

    def intermittent(self, p: float, from_step: int = 0, to_step: int | None = None) -> Fault:
        return dataclasses.replace(self, when=Intermittent(p=p, start=from_step, stop=to_step))

    # -- what -------------------------------------------------------------------------------
    def bitflip(
        self, bit: int | None = None, field: BitField = "mantissa", index: int | None = None
    ) -> Fault:
        return dataclasses.replace(self, what=BitFlip(bit=bit, field=field, index=index))

    def zero_chunk(self, width: int = 32, index: int | None = None) -> Fault:
        return dataclasses.replace(self, what=ZeroChunk(width=width, index=index))

    def scale(self, factor: float, count: int = 1, index: int | None = None) -> Fault:
        return dataclasses.replace(self, what=Scale(factor=factor, count=count, index=index))

    def nan(self, index: int | None = None) -> Fault:
        return dataclasses.replace(self, what=NonFinite(value="nan", index=index))

    def inf(self, negative: bool = False, index: int | None = None) -> Fault:
        return dataclasses.replace(self, what=NonFinite(value="-inf" if negative else "inf", index=index))

    def sdc_mix(self) -> Fault:
        """The published GPU SDC mix: mostly zeroed values and bit flips, ~1% NaN/Inf."""
        return dataclasses.replace(self, what=SdcMix())

    def corrupt(self, pattern: Pattern) -> Fault:
        return dataclasses.replace(self, what=pattern)

    # -- who --------------------------------------------------------------------------------
    def on_rank(self, rank: int) -> Fault:
        return dataclasses.replace(self, rank=rank, all_ranks=False)

    def on_all_ranks(self) -> Fault:
        """Act on every rank (say so explicitly: the default in a multi-rank job is an error)."""
        return dataclasses.replace(self, rank=None, all_ranks=True)

    def seeded(self, seed: int) -> Fault:
        return dataclasses.replace(self, seed=seed)

    def only_in(self, *passes: PassName) -> Fault:
        """Restrict to these guard passes (for example ``"train"`` only)."""
        return dataclasses.replace(self, passes=tuple(passes))

    # -- use --------------------------------------------------------------------------------
    @property
    def onset(self) -> int:
        return self.when.onset

    def describe(self) -> str:
        where = self.where.describe() if self.where is not None else "<nowhere>"
        who = " on every rank" if self.all_ranks else ("" if self.rank is None else f" on rank {self.rank}")
        return f"{self.what.describe()} in {where}, {self.when.describe()}{who}"

    def install(
        self,
        model: torch.nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        guard: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> FaultHandle:
        """Hook the fault into ``model`` (a DDP wrapper is looked through) on the chosen rank.

        Call it on every rank: each one checks the fault against the model and the job, so a
        mistake is the same clear FaultConfigError everywhere (not an error on the target rank
        and a transport error on the others). ``rank`` / ``world_size`` are this process's rank
        and the job's size (default: torch.distributed's, or 0 and 1).
        """
        if self.where is None:
            raise FaultConfigError("the fault has no site: start from Fault.at_*(...)")
        me = _this_rank() if rank is None else rank
        # Unknown only when the caller names its rank outside torch.distributed (simulations).
        world = world_size if world_size is not None else _world_size(explicit_rank=rank is not None)
        if world is None:
            pass
        elif self.rank is None and not self.all_ranks and world > 1:
            raise FaultConfigError(
                f"the fault names no rank in a {world}-rank job: choose .on_rank(R) with R in "
                f"0..{world - 1}, or .on_all_ranks()"
            )
        elif self.rank is not None and self.rank >= world:
            raise FaultConfigError(
                f"the fault is on rank {self.rank} but the job has {world} rank(s) (0..{world - 1}): "
                "it would never act"
            )
        bare = unwrap(model)
        check_names(self.where, bare)  # on every rank, before anything is hooked
        active = self.rank is None or self.rank == me
        handle = FaultHandle(self, me, active)
        if active:
            handle._removers = self.where.install(
                Targets(model=bare, optimizer=optimizer, guard=guard), handle
            )
        return handle


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size(*, explicit_rank: bool) -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None if explicit_rank else 1  # no process group and no rank given: one process
