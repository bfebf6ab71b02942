"""The guard inside torchft's step (issue 28; ``docs/no-restart.md``).

:class:`TorchftGuard` runs one guarded step per call on each rank of a torchft replica group (one
rank, or several with DDP or FSDP2 inside the group; the guard of rank ``l`` spans rank ``l`` of
every group, :mod:`replicheck.guard.parallel.torchft`, :mod:`replicheck.guard.parallel.torchft_sharded`):

1. ``Manager.start_quorum()`` (synchronous quorum); when the quorum changed (its id, this group's
   rank or the group count), the guard is built again over the groups now in it, so its ring,
   arbiters and node list are the quorum's;
2. the guard's step, numbered ``Manager.current_step()`` (a step voted down is taken again with
   the same number), its gradients averaged through ``Manager.allreduce``
   (:class:`~replicheck.guard.parallel.torchft.TorchftReplicas`);
3. the commit: a step that passed the guard's checks is applied only if ``Manager.should_commit()``
   says yes (asked from inside the guard's optimizer step, before any update);
4. a verdict naming replica groups: every group calls ``Manager.report_error`` and votes its step
   down (torchft's vote is per group), then the named groups exit with 87
   (:func:`replicheck.elastic.exit_on_corruption`) and the others return a step that was not
   committed; their next call takes the same step number in a quorum without the suspects.
   An ``ambiguous`` verdict (fewer than 3 groups, or no group named alone), or one that would leave
   fewer groups than the manager's ``min_replica_size``, is today's stop: every group votes down
   and raises :class:`~replicheck.guard.CorruptionDetected`. With several ranks per group the
   ranks' verdicts (one per column) are combined first: the group leaves only when every column
   with a verdict names the same single group; anything else is the stop.

A replacement group joins live: :class:`TorchftGuard` registers the model, the optimizer and the
guard's own state with the manager (``Manager.register_state_dict_fn``, key ``"replicheck"``), so
torchft's recovery hands a joining group all three from a healthy group inside its first
``start_quorum``. At every quorum change each group's weights and optimizer-state digests and its
guard state are all-gathered over the quorum (:class:`RecoveryCheck`); a group that healed in this
quorum takes part in the step only if its recovered state equals the healthy groups'. Otherwise
every group votes the step down, the joiner raises :class:`RecoveryRefused` (its manager shut
down) and the others take the step again without it. A bad copy is not silent corruption: no
incident is written, and no healthy group is named.

Needs ``pip install 'replicheck[torchft]'``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replicheck.elastic import exit_on_corruption
from replicheck.guard import CorruptionDetected, Guard, GuardConfig, StepResult
from replicheck.guard.errors import GuardConfigError, GuardError
from replicheck.guard.loss import LossFn
from replicheck.guard.parallel.torchft import TorchftReplicas
from replicheck.incident import Continuation, Incident, write_incident
from replicheck.integrations import require

log = logging.getLogger(__name__)


_LEAVES = frozenset({"persistent", "transient"})
"""Verdicts that send the named groups out: a device computed wrong, and the others agree."""


class _VotedDown(Exception):
    """Internal: ``should_commit`` said no to a step the guard passed (raised before the update)."""


_Outcome = Incident | str | None
"""A rank's outcome of a step its group did not commit: its column's verdict, the error that
stopped it (in words), or ``None`` (voted down by another rank or group)."""


RECOVERY_KEY = "replicheck"
"""The key :class:`TorchftGuard` registers with ``Manager.register_state_dict_fn``."""


@dataclass(frozen=True)
class RecoveryCheck:
    """The recovered-state check of one quorum (every group computes the same)."""

    step: int
    """The step the quorum takes (a joiner's first)."""
    healed: tuple[int, ...]
    """Quorum ranks of the groups that received a healthy group's state in this quorum."""
    refused: tuple[int, ...]
    """Those of them whose state differs from the healthy groups' (the step is voted down)."""
    states: tuple[tuple[int, ...], ...]
    """Per quorum rank: ``(torchft step, guard next step, guard last verified step or -1,
    weights digest, optimizer-state digest)`` at the start of the step."""


class RecoveryRefused(GuardError):
    """This group's recovered state differs from the healthy groups' at its first step (a bad
    copy): the step was voted down everywhere and this group's manager is shut down; let the
    process exit (not with 87: no device was found computing wrong)."""

    def __init__(self, check: RecoveryCheck, rank: int) -> None:
        self.check = check
        mine = check.states[rank]
        ref = [st for r, st in enumerate(check.states) if r not in check.healed]
        super().__init__(
            f"step {check.step}: the state recovered from a healthy replica group differs from the "
            f"quorum's (torchft step, guard next step, last verified step, weights digest, "
            f"optimizer digest: {mine} here, {ref} on the healthy groups); this group leaves"
        )


@dataclass(frozen=True)
class TorchftStep:
    """What :meth:`TorchftGuard.step` returns."""

    step: int
    """The step number taken (``Manager.current_step()`` at its start)."""
    committed: bool
    """Whether this group applied the step (the guard passed it and ``should_commit`` said yes)."""
    participants: int
    """Replica groups in this step's quorum."""
    result: StepResult | None = None
    """The guard's result, when its checks passed."""
    incident: Incident | None = None
    """The verdict that voted the step down and sent the named groups out, when there was one."""
    t_committed: float | None = None
    """``time.time()`` when the step was committed (measurements)."""
    recovery: RecoveryCheck | None = None
    """The recovered-state check of this step's quorum, when a group healed in it."""


class TorchftGuard:
    """A guarded step per call, on one rank of a torchft replica group (module docstring).

    One instance per rank. ``group``: the replica group's own process group, required when the
    group has several ranks (``Manager(world_size=k)``, ``k > 1``; under a ``torchrun`` per group,
    torch.distributed's default group); DDP runs inside it and torchft across the groups. A
    ``fully_shard`` module (FSDP2 over the group's ranks, a 1-D mesh on the default group) is
    guarded as such (:class:`~replicheck.guard.parallel.torchft_sharded.TorchftSharded`). Every
    rank of a group acts alike: the columns' verdicts are combined inside the group when a step is
    not committed (one small all-gather over the group's ranks, only then), and a recovered-state
    refusal in any column refuses the whole group.

    ``module`` is the bare model (the DDP wrapper torchft's averaging runs in is built here:
    :attr:`model` is what the loss function is called with in training passes). ``pg`` is the
    process group given to ``manager``. ``optimizer`` is the plain torch optimizer (not
    ``torchft.Optimizer``: the commit vote is asked here). ``node`` names this replica group in
    incidents (default: the host's node name from the environment); name it after the replica
    group (torchft's replica id), because the incident's ``continuation`` names the group that left
    by it and the controller starts the replacement group under that id.

    The incident of a verdict that sends a group out carries ``continuation`` (mode
    ``no_restart``, the suspect's node name as ``replica_group``; incident version 3), so the
    controller starts one replacement group after approval instead of resuming a job that never
    stopped. Any other verdict's incident is today's record. Either is written to
    ``config.incident_dir`` once, by the lowest quorum rank the verdict does not name (in the
    column whose verdict came first). Its ``suspect_ranks`` are quorum ranks: replica groups.

    The model, the optimizer and the guard's state are registered with ``manager`` for torchft's
    live recovery (key :data:`RECOVERY_KEY`), so there is no need to pass the model's and the
    optimizer's state functions to the ``Manager`` (if they are, they travel twice); register any
    other state (a learning-rate schedule, a data loader's position) under keys of your own. A
    group that healed is checked at its first step (module docstring); a refused one raises
    :class:`RecoveryRefused` from :meth:`begin` / :meth:`step`.
    """

    def __init__(
        self,
        manager: Any,
        pg: Any,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: GuardConfig | None = None,
        node: str | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        require("torchft", "torchft")
        self.manager = manager
        from torch.distributed.fsdp import FSDPModule

        from replicheck.guard.parallel.torchft_sharded import TorchftSharded

        self.replicas: TorchftReplicas | TorchftSharded
        if isinstance(module, FSDPModule):
            if group is not None and group is not dist.group.WORLD:
                raise GuardConfigError(
                    "FSDP2 inside a torchft replica group: the group is torch.distributed's "
                    "default group (a torchrun per replica group); leave group= out or pass "
                    "dist.group.WORLD"
                )
            self.replicas = TorchftSharded(manager, pg, module)
        else:
            self.replicas = TorchftReplicas(manager, pg, module, group)
        self._optimizer, self._loss_fn = optimizer, loss_fn
        cfg = config if config is not None else GuardConfig()
        # The incident is written here, once the verdict's consequence (leave or stop) is known.
        self._incident_dir, self._incident_mode = cfg.incident_dir, cfg.incident_mode
        self._config = dataclasses.replace(cfg, incident_dir=None)
        self._node = node
        self._guard: Guard | None = None
        self._quorum: tuple[object, int, int] | None = None
        self._begun: int | None = None
        self.reforms = 0
        """How many times the guard was built again for a new quorum (the first build included)."""
        self._hooked = False
        self._module = module
        self._recovered: dict[str, Any] | None = None  # the guard state received this quorum
        self._healed = False
        self._refusal: RecoveryCheck | None = None  # this step voted down for a bad copy
        self._check: RecoveryCheck | None = None  # this quorum's check, until its first step returns
        self.recovery: RecoveryCheck | None = None
        """The newest recovered-state check (a quorum in which some group healed)."""
        if RECOVERY_KEY in getattr(manager, "_user_state_dicts", {}):
            raise GuardConfigError(
                f"this torchft Manager already has state registered under {RECOVERY_KEY!r} (one "
                "TorchftGuard per Manager)"
            )
        manager.register_state_dict_fn(RECOVERY_KEY, self._load_recovered, self._recovery_state)

    def _recovery_state(self) -> dict[str, Any]:
        """What a healthy group sends a joining one (called by torchft between two steps)."""
        guard = self._guard.state_dict() if self._guard is not None else None
        return {"model": self._module.state_dict(), "optimizer": self._optimizer.state_dict(), "guard": guard}

    def _load_recovered(self, state: dict[str, Any]) -> None:
        """A healthy group's state, applied by torchft inside this group's ``start_quorum``; the
        guard's part is loaded once this quorum's guard exists (:meth:`begin`)."""
        self._module.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._recovered = state["guard"]
        self._healed = True

    @property
    def model(self) -> torch.nn.Module:
        """The DDP wrapper training passes call."""
        return self.replicas.model

    @property
    def guard(self) -> Guard:
        """The guard of the current quorum (after the first :meth:`begin`)."""
        if self._guard is None:
            raise GuardError("no quorum yet: call begin() or step() first")
        return self._guard

    def begin(self) -> int:
        """Join this step's quorum (re-forming the guard when it changed, and checking the state of
        any group that healed in it); returns the step number the next :meth:`step` takes.
        :meth:`step` calls it when it was not called. Raises :class:`RecoveryRefused` in a group
        whose recovered state differs from the quorum's."""
        if self._begun is not None:
            return self._begun
        self._healed, self._recovered, self._check = False, None, None
        self.manager.start_quorum()
        comm = self.replicas.quorum_comm
        rank, size = comm.refresh()
        # The manager reconfigures its process group whenever the quorum id changes; the id has no
        # public accessor in torchft 0.2.
        key = (getattr(self.manager, "_quorum_id", None), rank, size)
        changed = key != self._quorum
        if changed:
            self._reform()
            self._quorum = key
        step = int(self.manager.current_step())
        guard = self.guard
        if self._recovered is not None:
            # A live load at this step boundary: the healthy group's next and verified steps.
            guard.load_state_dict(self._recovered)
        if guard.next_step != step:
            guard.load_state_dict({**guard.state_dict(), "next_step": step})
        if changed:
            # Every group re-forms on a quorum change (a joiner's first quorum is one), so every
            # group takes part in this gather.
            self._check_recovery(step)
        self._begun = step
        return step

    def _check_recovery(self, step: int) -> None:
        """Collective over the quorum: each group's state digests; a group that healed in this
        quorum must hold the healthy groups' state, or the step is voted down everywhere and the
        joiner leaves (:class:`RecoveryRefused`). Each rank checks its column; a refusal in any
        column of a group refuses the whole group (:meth:`_group_flags`)."""
        comm, guard = self.replicas.quorum_comm, self.guard
        verified = guard.last_verified_step
        head = [int(self._healed), step, guard.next_step, -1 if verified is None else verified]
        digests = [
            self.replicas.weights_digest(self._config.per_rank_buffers),
            self.replicas.optimizer_digest(self._optimizer),
        ]
        row = torch.cat([torch.tensor(head, dtype=torch.int64), torch.stack(digests).to("cpu", torch.int64)])
        rows = [tuple(int(v) for v in r) for r in comm.gather_rows(row).tolist()]
        healed = tuple(r for r, got in enumerate(rows) if got[0])
        check: RecoveryCheck | None = None
        if healed:
            states = tuple(got[1:] for got in rows)
            reference = {st for r, st in enumerate(states) if r not in healed}
            if len(reference) == 1:
                refused = tuple(r for r in healed if states[r] not in reference)
            else:
                # No agreed reference (no healthy group, or healthy groups that differ, which the
                # guard's own replica check judges): no joiner can be shown to hold the right state.
                refused = healed
            check = RecoveryCheck(step=step, healed=healed, refused=refused, states=states)
            self.recovery = self._check = check
        # Every rank of every group takes part (a joiner's first quorum changes it everywhere).
        any_refused, this_group = self._group_flags(
            check is not None and bool(check.refused), check is not None and comm.rank in check.refused
        )
        if not any_refused:
            if check is not None:
                log.info("step %d: the recovered state of group(s) %s equals the quorum's", step, healed)
            return
        if check is None:
            raise GuardError("internal: a refusal in a column of a quorum in which no group healed")
        # A bad copy, not silent corruption: every group votes the step down (torchft's vote is
        # per group), the joiner leaves, and no incident is written (none would name a device).
        self.manager.report_error(RecoveryRefused(check, comm.rank))
        if self.manager.should_commit():
            raise GuardError(f"internal: step {step} committed after report_error")
        if this_group:
            refusal = RecoveryRefused(check, comm.rank)
            log.error("%s", refusal)
            # Stop heartbeating at once, so the lighthouse drops this group from the next quorum.
            self.manager.shutdown(wait=False)
            raise refusal
        log.error(
            "step %d: the recovered state of group(s) %s refused; the step is taken again",
            step,
            check.refused,
        )
        self._refusal = check

    def _group_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true when it is true on any rank of this replica group (collective over the
        group's ranks; nothing to share with one rank)."""
        group = self.replicas.group
        if group is None:
            return flags
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return tuple(bool(v) for v in t.tolist())

    def _group_outcomes(self, mine: _Outcome) -> list[_Outcome]:
        """Every rank's outcome of a step this group did not commit, in the group's rank order
        (collective over the group's ranks; every rank of a group reaches it, since torchft's
        commit vote is one for the whole group)."""
        group = self.replicas.group
        if group is None:
            return [mine]
        out: list[_Outcome] = [None] * self.replicas.group_size
        dist.all_gather_object(out, mine, group=group)
        return out

    def _reform(self) -> None:
        """A guard over the groups in the new quorum: its ring, arbiters and nodes are theirs."""
        old = self._guard
        guard = Guard(
            self.replicas.model,
            self._optimizer,
            self._loss_fn,
            self._config,
            node=self._node,
            parallelism=self.replicas,
        )
        if old is not None:
            guard.load_state_dict(old.state_dict())
        self._guard = guard
        self.reforms += 1
        if not self._hooked:
            # After the guard's own gate (registered by the first guard), so a step the gate
            # refuses never reaches the vote.
            self._optimizer.register_step_pre_hook(self._commit_vote)
            self._hooked = True
        log.info("replicheck: guard re-formed over %d replica group(s)", self.replicas.comm.world_size)

    def _commit_vote(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.manager.should_commit():
            raise _VotedDown

    def step(self, *microbatches: Any) -> TorchftStep:
        """One guarded step (module docstring). Exits the process with 87 when a verdict names
        this group; raises ``CorruptionDetected`` on every group when it names none alone."""
        s = self.begin()
        self._begun = None
        guard, n = self.guard, self.replicas.comm.world_size
        check, self._check = self._check, None
        if self._refusal is not None:
            # Voted down in begin() (a joiner's bad copy): no group computes this step.
            self._refusal = None
            return TorchftStep(step=s, committed=False, participants=n, recovery=check)
        mine: _Outcome = None
        try:
            result = guard.step(*microbatches)
        except _VotedDown:
            pass
        except CorruptionDetected as exc:
            # Every group holds its column's verdict (the guard's judgement is collective over the
            # column): each votes its own step down, since torchft's should_commit counts only the
            # group's own ranks.
            self.manager.report_error(exc)
            if self.manager.should_commit():
                raise GuardError(f"internal: step {s} committed after report_error") from exc
            mine = exc.incident
        except BaseException as exc:
            # Whatever stopped the step here stops it in this group's vote too, and the group's
            # other ranks (waiting in the vote or in the outcomes) stop with it.
            self.manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if self.replicas.group is not None:
                self.manager.should_commit()
                self._group_outcomes(f"{type(exc).__name__}: {exc}")
            raise
        else:
            return TorchftStep(
                step=s, committed=True, participants=n, result=result, t_committed=time.time(), recovery=check
            )
        outcomes = self._group_outcomes(mine)
        for rank, got in enumerate(outcomes):
            if isinstance(got, str):
                raise GuardError(
                    f"step {s}: rank {rank} of this replica group failed ({got}); every group voted "
                    "the step down"
                )
        verdicts = [(rank, got) for rank, got in enumerate(outcomes) if isinstance(got, Incident)]
        if not verdicts:
            log.warning("step %d: torchft's commit vote said no; it is taken again", s)
            return TorchftStep(step=s, committed=False, participants=n, recovery=check)
        return dataclasses.replace(self._verdict(s, n, verdicts), recovery=check)

    def _verdict(self, s: int, n: int, verdicts: list[tuple[int, Incident]]) -> TorchftStep:
        """The group's decision from its columns' verdicts (``(group rank, incident)``, in rank
        order): the same in every group, since each column's verdict is the same in every group.
        The first column's incident is the one written and raised."""
        column, incident = verdicts[0]
        suspects = set(incident.suspect_ranks)
        minimum = int(getattr(self.manager, "_min_replica_size", 1))
        leaves = all(
            got.classification in _LEAVES
            and len(set(got.suspect_ranks)) == 1
            and len(got.suspect_nodes) == 1
            and got.suspect_nodes == incident.suspect_nodes
            and set(got.suspect_ranks) == suspects
            for _, got in verdicts
        )
        if not leaves or n - len(suspects) < max(minimum, 1):
            # Today's stop: no group can be trusted alone (ambiguous), the batch or the run is at
            # fault rather than a device (data, divergence), more than one group is named (one
            # replacement at a time), the columns disagree on the group, or too few groups would
            # be left.
            self._write(incident, column)
            raise CorruptionDetected(incident)
        incident = dataclasses.replace(
            incident, continuation=Continuation(mode="no_restart", replica_group=incident.suspect_nodes[0])
        )
        self._write(incident, column)
        if self.replicas.comm.rank in suspects:
            log.error("step %d: this replica group is named (%s); it leaves the quorum", s, incident.id)
            # Stop heartbeating at once (the lighthouse drops a silent group), then 87 as today.
            self.manager.shutdown(wait=False)
            exit_on_corruption(incident)
        log.warning(
            "step %d: replica group %s named (%s); the step is taken again without it",
            s,
            incident.suspect_nodes[0],
            incident.id,
        )
        return TorchftStep(step=s, committed=False, participants=n, incident=incident)

    def _write(self, incident: Incident, column: int) -> None:
        """The incident file, once: from the rank of ``column`` (a rank within the groups) in the
        lowest quorum rank the verdict does not name."""
        if self._incident_dir is None:
            return
        named = set(incident.suspect_ranks)
        writer = min((r for r in range(self.replicas.comm.world_size) if r not in named), default=0)
        if self.replicas.comm.rank == writer and self.replicas.group_rank == column:
            path = write_incident(incident, self._incident_dir, mode=self._incident_mode)
            log.error("incident %s written to %s", incident.id, path)


__all__ = ["RECOVERY_KEY", "RecoveryCheck", "RecoveryRefused", "TorchftGuard", "TorchftStep"]
