"""Where a fault acts: the hardware paths the injector can corrupt on one rank.

Each site is a frozen description naming modules and parameters by their names in the bare
model (as ``named_modules()`` / ``named_parameters()`` spell them). :meth:`install` wires hooks
that offer every corruption opportunity (an *event*) to the injector's :class:`Sink`, and
returns the functions that remove them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replicheck.faults.errors import FaultConfigError
from replicheck.guard.context import PassName, current_pass, current_step

Remover = Callable[[], None]

# Matrix products as they reach the dispatcher (``linear``/``matmul`` decompose into these).
MATMUL_OPS: tuple[str, ...] = ("mm", "addmm", "bmm", "baddbmm")


class Sink(Protocol):
    """What a site hands its tensors to (the injector)."""

    def offer(
        self, tensor: torch.Tensor, name: str, *, step: int | None = None, pass_: PassName | None = None
    ) -> None: ...


@dataclass
class Targets:
    """What an install may hook: the bare model, and the optimizer and guard when given."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    guard: Any = None


_SHOWN_NAMES = 60
"""At most this many valid names are listed in an error (a big model has thousands)."""


def _valid(kind: str, name: str, names: list[str]) -> FaultConfigError:
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    more = f", ... ({len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else ""
    return FaultConfigError(f"no {kind} named {name!r} in the model; valid names: {shown}{more}")


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    modules = dict(model.named_modules())
    if name not in modules:
        raise _valid("module", name, [n for n in modules if n])
    return modules[name]


def _param(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    params = dict(model.named_parameters())
    if name not in params:
        raise _valid("parameter", name, list(params))
    return params[name]


def check_names(site: object, model: torch.nn.Module) -> None:
    """Resolve the module or parameter ``site`` names in ``model`` (the bare model), raising
    FaultConfigError with the valid names; installs nothing (run on every rank)."""
    module = getattr(site, "module", None)
    if isinstance(module, str):
        _module(model, module)
    param = getattr(site, "param", None)
    if isinstance(param, str):
        _param(model, param)


@runtime_checkable
class Site(Protocol):
    def install(self, targets: Targets, sink: Sink) -> list[Remover]: ...

    def describe(self) -> str: ...


class _OpFaults(TorchDispatchMode):
    """Active only inside one module's forward: offers the outputs of the chosen ops."""

    def __init__(self, ops: tuple[str, ...], module_name: str, sink: Sink) -> None:
        super().__init__()
        self.ops, self.module_name, self.sink = ops, module_name, sink
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.ops and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.sink.offer(out, f"{self.module_name}:{name}#{self.count}")
            self.count += 1
        return out


@dataclass(frozen=True, kw_only=True)
class Forward:
    """A forward activation: the output of a named module, or the outputs of ops inside it.

    The change is made behind autograd's back, as a faulty unit would: the backward pass uses
    the corrupted value wherever it was saved, and nothing else.
    """

    module: str
    """Module name in the bare model (``""`` is the whole model)."""
    ops: Literal["output", "matmul"] | tuple[str, ...] = "output"
    """``output``: the module's (first) output tensor. ``matmul``: every matrix product inside
    its forward. A tuple: these aten op names (``("mm", "addmm")``)."""

    def install(self, targets: Targets, sink: Sink) -> list[Remover]:
        mod = _module(targets.model, self.module)
        label = self.module or "<model>"
        if self.ops == "output":

            def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
                t = (
                    out
                    if isinstance(out, torch.Tensor)
                    else (out[0] if isinstance(out, (tuple, list)) and out else None)
                )
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    sink.offer(t.data, f"{label}.output")

            return [mod.register_forward_hook(hook).remove]
        ops = MATMUL_OPS if self.ops == "matmul" else tuple(self.ops)
        active: list[_OpFaults] = []

        def enter(_m: torch.nn.Module, _inp: Any) -> None:
            mode = _OpFaults(ops, label, sink)
            mode.__enter__()
            active.append(mode)

        def leave(_m: torch.nn.Module, _inp: Any, _out: Any) -> None:
            if active:
                active.pop().__exit__(None, None, None)

        handles = [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave, always_call=True)]
        return [h.remove for h in handles]

    def describe(self) -> str:
        what = (
            "output" if self.ops == "output" else ("matmuls" if self.ops == "matmul" else "/".join(self.ops))
        )
        return f"forward {what} of {self.module or '<model>'}"


@dataclass(frozen=True, kw_only=True)
class _ParamSite:
    """A site on one named parameter of the bare model."""

    param: str
    """Parameter name in the bare model."""


@dataclass(frozen=True, kw_only=True)
class WeightGradient(_ParamSite):
    """The gradient of one parameter, as its backward kernel produces it (forward untouched)."""

    def install(self, targets: Targets, sink: Sink) -> list[Remover]:
        p = _param(targets.model, self.param)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            out = grad.clone()
            sink.offer(out, f"{self.param}.grad")
            return out

        if not _is_sharded(p):
            return [p.register_hook(hook).remove]
        # FSDP2: the backward computes the gradient of the whole (all-gathered) parameter the
        # owning module holds during its forward; hook that one, once per tensor FSDP makes.
        owner_name, _, leaf = self.param.rpartition(".")
        owner = _module(targets.model, owner_name) if owner_name else targets.model
        hooked: dict[int, Remover] = {}

        def pre(_m: torch.nn.Module, _inp: Any) -> None:
            whole = getattr(owner, leaf)
            if isinstance(whole, torch.Tensor) and whole.requires_grad and id(whole) not in hooked:
                hooked[id(whole)] = whole.register_hook(hook).remove

        def remove_all() -> None:
            for r in hooked.values():
                r()

        return [owner.register_forward_pre_hook(pre).remove, remove_all]

    def describe(self) -> str:
        return f"weight gradient of {self.param}"


@dataclass(frozen=True, kw_only=True)
class OptimizerUpdate(_ParamSite):
    """The update the optimizer applies to one parameter (the step's delta is corrupted)."""

    def install(self, targets: Targets, sink: Sink) -> list[Remover]:
        if targets.optimizer is None:
            raise FaultConfigError("an optimizer-update fault needs the optimizer")
        p = _param(targets.model, self.param)
        saved: list[torch.Tensor] = []

        def pre(_opt: Any, _args: Any, _kwargs: Any) -> None:
            saved[:] = [_held(p).clone()]

        def post(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if not saved:
                return
            before = saved.pop()
            held = _held(p)  # this rank's shard of a sharded parameter
            with torch.no_grad():
                delta = (held - before).reshape(-1)
                original = delta.clone()
                sink.offer(delta, f"{self.param}.update", pass_="optimizer")
                changed = (delta != original) | (delta.isnan() != original.isnan())
                if bool(changed.any()):
                    idx = changed.nonzero().flatten()
                    held.view(-1)[idx] = before.view(-1)[idx] + delta[idx]

        handles = [
            targets.optimizer.register_step_pre_hook(pre),
            targets.optimizer.register_step_post_hook(post),
        ]
        return [h.remove for h in handles]

    def describe(self) -> str:
        return f"optimizer update of {self.param}"


@dataclass(frozen=True, kw_only=True)
class WeightsAtRest(_ParamSite):
    """A parameter's stored values, corrupted between steps (before the step's first forward)."""

    def install(self, targets: Targets, sink: Sink) -> list[Remover]:
        p = _param(targets.model, self.param)
        seen: set[int] = set()

        def pre(_m: torch.nn.Module, _inp: Any) -> None:
            step = current_step()
            if step < 0 or step in seen:
                return
            seen.add(step)
            sink.offer(_held(p), self.param, step=step, pass_="idle")

        return [targets.model.register_forward_pre_hook(pre).remove]

    def describe(self) -> str:
        return f"{self.param} at rest"


@dataclass(frozen=True, kw_only=True)
class ReducedGradient:
    """A bucket of the gradient after the all-reduce, on this rank only (needs the guard)."""

    bucket: int | None = None
    """Bucket index to hit; ``None``: any bucket."""

    def install(self, targets: Targets, sink: Sink) -> list[Remover]:
        guard = targets.guard
        if guard is None:
            raise FaultConfigError("a reduced-gradient fault needs the guard (its reduced-gradient hook)")

        def hook(index: int, tensor: torch.Tensor) -> None:
            if self.bucket is not None and index != self.bucket:
                return
            # The hook may run on the communication thread, where the guard's context is not
            # set: the guard's own step counter says which step is being reduced.
            sink.offer(tensor, f"reduced_bucket[{index}]", step=guard.next_step, pass_="train")

        return [guard.add_reduced_gradient_hook(hook)]

    def describe(self) -> str:
        return "reduced gradient" + ("" if self.bucket is None else f" bucket {self.bucket}")


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and hasattr(p, "device_mesh")  # a DTensor, without importing it


def _held(p: torch.Tensor) -> torch.Tensor:
    """The values of ``p`` this rank stores (its shard of a sharded parameter), detached."""
    held: torch.Tensor = p.to_local() if _is_sharded(p) else p  # type: ignore[attr-defined]
    return held.detach()


def context() -> tuple[int, PassName]:
    """The step and pass the guard is in now (``-1``/``idle`` outside a guarded step)."""
    return current_step(), current_pass()
