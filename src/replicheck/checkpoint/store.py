"""The checkpoint store: collective, atomic, verified saves; the clean resume point; verified
loads that fall back to the next older checkpoint; retention that keeps the resume point."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from replicheck import fingerprint as fp
from replicheck.checkpoint import atomic, sharded
from replicheck.checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointWarning,
    CheckpointWriteError,
    ManifestError,
    NoValidCheckpoint,
)
from replicheck.checkpoint.manifest import (
    MANIFEST_NAME,
    PAYLOAD_FORMAT,
    PAYLOAD_NAME,
    Manifest,
    digest_hex,
)
from replicheck.checkpoint.policy import (
    POLICIES,
    Policy,
    check_policy,
    clean_bound,
    eligible,
)
from replicheck.checkpoint.record import Checkpoint
from replicheck.checkpoint.restore import read_verified, restore
from replicheck.guard.modules import unwrap
from replicheck.guard.transport.comm import Comm
from replicheck.incident import Incident, IncidentFormatError, read_incident

if TYPE_CHECKING:
    from replicheck.guard import Guard

log = logging.getLogger("replicheck.checkpoint")

SUPERSEDED = "superseded"
_NAME = re.compile(r"^step-([0-9]{9,})$")  # ASCII digits only (\d matches other scripts' digits)

IncidentLike = Incident | Mapping[str, Any] | str | bytes | os.PathLike[str]
"""An :class:`Incident`, its dict, its JSON text, or the path of the JSON file."""


def _dir_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class Loaded:
    """What :meth:`CheckpointStore.load` actually restored."""

    checkpoint: Checkpoint
    """The checkpoint restored (older than the one asked for when that one was refused)."""
    extra: Any
    """The ``extra`` object given to :meth:`CheckpointStore.save`."""
    refused: tuple[str, ...] = ()
    """Why each newer candidate was refused, one message per checkpoint."""
    guard_state: dict[str, Any] | None = None
    """The guard's state saved with it (``Guard.state_dict()``), or ``None`` when saved without
    a guard."""


@dataclass(frozen=True)
class _Lineage:
    """What a checkpoint's manifest records about the run that saved it."""

    last_verified_step: int | None
    verify_every: int | None
    replicas_checked: bool
    world_size: int

    def fields(self) -> dict[str, Any]:
        """The manifest fields it fills."""
        return dataclasses.asdict(self)


def _check_extra(value: Any, where: str = "extra") -> None:
    """``extra`` must load under ``torch.load(weights_only=True)``: plain containers, scalars, tensors."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_extra(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointConfigError(f"{where}: keys must be str or int, got {type(k).__name__}")
            _check_extra(v, f"{where}[{k!r}]")
        return
    raise CheckpointConfigError(
        f"{where}: {type(value).__name__} cannot be stored (use dicts, lists, numbers, strings, tensors)"
    )


def _as_incident(incident: IncidentLike) -> Incident:
    try:
        if isinstance(incident, Incident):
            return incident
        if isinstance(incident, Mapping):
            return Incident.from_dict(incident)
        if isinstance(incident, bytes):
            return Incident.from_json(incident)
        if isinstance(incident, str) and incident.lstrip().startswith("{"):
            return Incident.from_json(incident)
        if isinstance(incident, (str, os.PathLike)):
            return read_incident(incident)
    except IncidentFormatError as exc:
        raise CheckpointConfigError(f"bad incident: {exc}") from exc
    raise CheckpointConfigError(
        f"incident must be an Incident, a dict, JSON text or a path, not {type(incident).__name__}"
    )


class CheckpointStore:
    """Verified checkpoints in one directory, one subdirectory per step.

    Layout: ``<directory>/step-<9+ digits>/{manifest.json,state.pt}``; checkpoints of an abandoned
    timeline (newer than a checkpoint resumed from) are moved to ``<directory>/superseded/``.
    With DDP, every rank calls :meth:`save` (rank 0 writes) and every rank may :meth:`load`.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 5) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise CheckpointConfigError(f"keep must be an integer >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.writer_rank = 0
        self.loaded: Loaded | None = None
        """The last checkpoint restored by :meth:`load` in this process."""
        self._verified: dict[Path, tuple[int, int, str]] = {}

    # -- listing ------------------------------------------------------------------------------
    def _require_dir(self) -> None:
        if not self.directory.is_dir():
            raise CheckpointNotFound(f"checkpoint directory {self.directory} does not exist")

    def _read_manifest(self, path: Path) -> Manifest:
        try:
            text = (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            raise ManifestError(f"{path}: no {MANIFEST_NAME}") from None
        except OSError as exc:
            raise ManifestError(f"{path}: cannot read {MANIFEST_NAME}: {exc}") from exc
        try:
            manifest = Manifest.from_json(text)
        except ManifestError as exc:
            raise ManifestError(f"{path / MANIFEST_NAME}: {exc}") from None
        match = _NAME.match(path.name)
        if match is None or int(match.group(1)) != manifest.step:
            raise ManifestError(f"{path}: manifest says step {manifest.step}, the directory name disagrees")
        return manifest

    def scan(self) -> tuple[list[Checkpoint], list[str]]:
        """All committed checkpoints with a readable manifest (oldest first), and one message per
        checkpoint directory whose manifest is unreadable."""
        self._require_dir()
        found: list[Checkpoint] = []
        bad: list[str] = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match is None or not entry.is_dir():
                continue
            try:
                manifest = self._read_manifest(entry)
            except ManifestError as exc:
                bad.append(str(exc))
                continue
            found.append(Checkpoint(step=manifest.step, path=entry, manifest=manifest))
        found.sort(key=lambda c: c.step)
        return found, bad

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints with a readable manifest, oldest first (payloads not verified)."""
        return self.scan()[0]

    # -- saving -------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        guard: Guard | None = None,
        extra: Any = None,
    ) -> Checkpoint:
        """Collective: checkpoint the state after step ``step``'s update.

        With ``guard``, first runs ``guard.check_replicas()`` (collective; raises
        ``CorruptionDetected`` and writes nothing when replicas disagree), and stores
        ``guard.state_dict()`` with the checkpoint (:meth:`load` with ``guard=`` restores it, so
        the resumed guard continues the step count, the verification schedule and tolerant
        mode's calibration). Rank 0 writes atomically
        and applies retention; a write failure is raised on every rank as
        :class:`CheckpointWriteError`. Returns the committed checkpoint on every rank.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointConfigError(f"step must be a non-negative integer, got {step!r}")
        _check_extra(extra)
        comm = guard.comm if guard is not None else Comm()
        checked = False
        if guard is not None:
            guard.check_replicas()
            checked = comm.world_size > 1
        guard_state = guard.state_dict() if guard is not None else None
        lineage = _Lineage(
            last_verified_step=self._lineage_verified(
                guard.last_verified_step if guard is not None else None
            ),
            verify_every=guard.config.verify_every if guard is not None else None,
            replicas_checked=checked,
            world_size=comm.world_size,
        )
        if sharded.is_sharded(unwrap(model)):
            staged, digests = sharded.stage(
                self.directory / _dir_name(step), self.writer_rank, step, model, optimizer, comm
            )
            write = functools.partial(self._commit_shards, step, staged, extra, lineage, digests, guard_state)
        else:
            write = functools.partial(self._write, step, model, optimizer, extra, lineage, guard_state)
        outcome: tuple[bool, Any] | None = None
        if comm.rank == self.writer_rank:
            try:
                outcome = (True, write().to_dict())
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                log.error("checkpoint at step %d not written: %s", step, exc)
                outcome = (False, f"{type(exc).__name__}: {exc}")
        written = comm.gather_objects(outcome)[self.writer_rank]
        if written is None:
            raise CheckpointWriteError(
                f"rank {self.writer_rank} reported nothing for the checkpoint of step {step}"
            )
        ok, value = written
        if not ok:
            raise CheckpointWriteError(
                f"rank {self.writer_rank} could not write the checkpoint of step {step}: {value}"
            )
        manifest = Manifest.from_dict(value)
        return Checkpoint(step=step, path=self.directory / _dir_name(step), manifest=manifest)

    def _commit_shards(
        self,
        step: int,
        staged: Path,
        extra: Any,
        lineage: _Lineage,
        digests: tuple[str, str, int],
        guard_state: dict[str, Any] | None = None,
    ) -> Manifest:
        """The writer's part of a sharded save: ``extra``, the guard's state, the manifest, the
        atomic commit."""

        def manifest() -> Manifest:
            if extra is not None:
                atomic.write_file(staged / sharded.EXTRA_NAME, lambda fh: torch.save(extra, fh))
            if guard_state is not None:
                atomic.write_file(staged / sharded.GUARD_NAME, lambda fh: torch.save(guard_state, fh))
            weights, opt, count = digests
            return sharded.manifest_for(
                staged,
                dict(
                    step=step,
                    weights_digest=weights,
                    optimizer_digest=opt,
                    num_params=count,
                    **lineage.fields(),
                ),
            )

        return self._publish(staged, manifest)

    def _lineage_verified(self, guard_verified: int | None) -> int | None:
        if guard_verified is not None:
            return guard_verified
        if self.loaded is not None:
            return self.loaded.checkpoint.last_verified_step
        return None

    def _write(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Any,
        lineage: _Lineage,
        guard_state: dict[str, Any] | None = None,
    ) -> Manifest:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic.clean_leftovers(self.directory)
        bare = unwrap(model)
        params = [p for _, p in fp.named_weights(bare, "all")]
        opt_state = optimizer.state_dict()
        payload = {
            "format": PAYLOAD_FORMAT,
            "step": step,
            "model": bare.state_dict(),
            "optimizer": opt_state,
            "extra": extra,
            "guard": guard_state,
        }
        staged = atomic.staging_dir(self.directory, _dir_name(step))

        def manifest() -> Manifest:
            atomic.write_file(staged / PAYLOAD_NAME, lambda fh: torch.save(payload, fh))
            sha, size = atomic.sha256_file(staged / PAYLOAD_NAME)
            return Manifest(
                step=step,
                weights_digest=digest_hex(fp.weights_digest(params)),
                optimizer_digest=digest_hex(fp.optimizer_digest(opt_state["state"])),
                payload_sha256=sha,
                payload_bytes=size,
                num_params=len(params),
                **lineage.fields(),
            )

        return self._publish(staged, manifest)

    def _publish(self, staged: Path, make: Callable[[], Manifest]) -> Manifest:
        """Finish a staged checkpoint (``make`` writes what is left and returns its manifest),
        write the manifest, commit it under its step's name (an older checkpoint of the same or a
        later step moves to ``superseded/`` first) and apply retention; any failure removes the
        staging directory."""
        try:
            manifest = make()
            atomic.write_file(staged / MANIFEST_NAME, lambda fh: _write_all(fh, manifest.to_json().encode()))
            self._supersede(lambda s: s >= manifest.step)
            atomic.commit(staged, self.directory / _dir_name(manifest.step))
        except BaseException:
            if staged.exists():
                atomic.remove_tree(staged)
            raise
        self._retain(manifest)
        return manifest

    def _supersede(self, newer: Callable[[int], bool]) -> list[Path]:
        """Move checkpoints of an abandoned timeline into ``superseded/`` (kept for forensics)."""
        moved = []
        for entry in sorted(self.directory.iterdir()):
            match = _NAME.match(entry.name)
            if match is not None and entry.is_dir() and newer(int(match.group(1))):
                moved.append(atomic.move_aside(entry, self.directory / SUPERSEDED))
                self._verified.pop(entry, None)
                log.warning("checkpoint %s belongs to an abandoned timeline: moved to %s", entry, moved[-1])
        if moved:
            old = sorted(
                (p for p in (self.directory / SUPERSEDED).iterdir() if p.is_dir()),
                key=lambda p: p.stat().st_mtime,
            )
            for p in old[: max(0, len(old) - self.keep)]:
                atomic.remove_tree(p)
        return moved

    def retire_after(self, step: int) -> list[Path]:
        """Move checkpoints newer than ``step`` (``-1``: all) into ``superseded/``: they belong to a
        timeline abandoned by resuming from ``step``. Call it on one rank only (rank 0)."""
        self._require_dir()
        return self._supersede(lambda s: s > step)

    def protected(self, latest: Manifest | None = None) -> list[Checkpoint]:
        """Checkpoints retention must keep beyond the newest ``keep``: the resume points, under
        both policies, of an incident that would strike right after ``latest`` was saved."""
        found = self.checkpoints()
        if not found:
            return []
        latest = latest or found[-1].manifest
        if latest.last_verified_step is None:
            return []
        probe = Incident(
            id="retention",
            job_id="retention",
            step=latest.step + 1,
            check="replay",
            suspect_ranks=(),
            suspect_nodes=(),
            classification="ambiguous",
            last_verified_step=latest.last_verified_step,
        )
        keep = []
        manifests = [c.manifest for c in found]
        for policy in POLICIES:
            bound = clean_bound(probe, manifests, policy)
            ok = [c for c in found if eligible(c.step, probe, bound)]
            if ok:
                keep.append(ok[-1])
        return keep

    def _retain(self, latest: Manifest) -> None:
        found, _ = self.scan()
        keep = {c.path for c in found[-self.keep :]} | {c.path for c in self.protected(latest)}
        for c in found:
            if c.path not in keep:
                atomic.remove_tree(c.path)
                self._verified.pop(c.path, None)
                log.info("retention: removed checkpoint of step %d", c.step)

    # -- choosing -----------------------------------------------------------------------------
    def resume_point(
        self, incident: IncidentLike | None = None, policy: Policy = "last_pass"
    ) -> Checkpoint | None:
        """The checkpoint to resume from, or ``None`` when no valid one qualifies (start over).

        Without an incident: the newest valid checkpoint. With one: the newest valid checkpoint
        whose step is not after the last passing verification before it (``"last_pass"``) or
        the one before that (``"two_passes"``). "Valid" means its manifest reads and its payload
        matches the manifest's size and SHA-256; refused ones are skipped with a warning.
        """
        check_policy(policy)
        inc = _as_incident(incident) if incident is not None else None
        found, bad = self.scan()
        for message in bad:
            log.warning("refused: %s", message)
        bound = clean_bound(inc, [c.manifest for c in found], policy)
        for c in reversed(found):
            if not eligible(c.step, inc, bound):
                continue
            try:
                self._check_payload(c.path, c.manifest)
            except CheckpointError as exc:
                self._refuse(f"{c.path}: {exc}")
                continue
            return c
        return None

    def annotate(self, incident: IncidentLike, policy: Policy = "last_pass") -> Incident:
        """The incident with ``recommended_checkpoint`` filled in (``None`` when none qualifies)."""
        inc = _as_incident(incident)
        ckpt = self.resume_point(inc, policy=policy)
        return dataclasses.replace(inc, recommended_checkpoint=ckpt.ref() if ckpt is not None else None)

    # -- loading ------------------------------------------------------------------------------
    def _refuse(self, message: str) -> None:
        log.warning("checkpoint refused: %s", message)
        warnings.warn(f"checkpoint refused: {message}", CheckpointWarning, stacklevel=3)

    def _check_payload(self, path: Path, manifest: Manifest) -> Path:
        payload = path / manifest.payload
        if manifest.sharded:
            sharded.verify(path, manifest)
            return payload
        try:
            st = payload.stat()
        except OSError as exc:
            raise CheckpointCorrupt(f"payload {manifest.payload} missing: {exc.strerror}") from None
        if st.st_size != manifest.payload_bytes:
            raise CheckpointCorrupt(
                f"payload is {st.st_size} bytes, the manifest says {manifest.payload_bytes} (truncated or replaced)"
            )
        key = (st.st_size, st.st_mtime_ns, manifest.payload_sha256)
        if self._verified.get(path) == key:
            return payload
        sha, _ = atomic.sha256_file(payload)
        if sha != manifest.payload_sha256:
            raise CheckpointCorrupt("payload SHA-256 does not match the manifest (bytes changed on disk)")
        self._verified[path] = key
        return payload

    def load(
        self,
        ckpt: Checkpoint | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        guard: Guard | None = None,
        retire_newer: bool = True,
    ) -> int:
        """Verify and restore ``ckpt`` into ``model`` (and ``optimizer``); return the step restored.

        A checkpoint that fails verification (corruption at rest, a truncated payload, a manifest
        whose fingerprint disagrees) is refused with a :class:`CheckpointWarning` naming it and
        the reason, and the next older valid one is used: the returned step is then smaller than
        ``ckpt.step``. Nothing is restored until a checkpoint passes every check; the restored
        weights are fingerprinted again. With ``retire_newer``, rank 0 moves checkpoints newer
        than the restored one (an abandoned timeline) into ``superseded/``. With ``guard`` (built
        over the same model and optimizer, before its first step), the guard's state saved with
        the checkpoint is restored into it (``Guard.load_state_dict``; a checkpoint saved without
        a guard warns and leaves the guard as it is: pass ``GuardConfig(start_step=step + 1)``).
        Raises :class:`NoValidCheckpoint` when every candidate is refused,
        :class:`CheckpointMismatch` when a valid checkpoint does not fit the model or optimizer.
        """
        if ckpt is None:
            raise CheckpointNotFound(f"no checkpoint to load from {self.directory} (resume_point found none)")
        if not isinstance(ckpt, Checkpoint):
            raise CheckpointConfigError(f"load() needs a Checkpoint, got {type(ckpt).__name__}")
        self._require_dir()
        older = [c for c in reversed(self.checkpoints()) if c.step < ckpt.step]
        refused: list[str] = []
        candidates = [ckpt, *older]
        for i, cand in enumerate(candidates):
            read: tuple[Manifest, dict[str, Any]] | None = None
            problem: str | None = None
            try:
                read = read_verified(
                    cand, model, read_manifest=self._read_manifest, check_payload=self._check_payload
                )
            except (CheckpointCorrupt, ManifestError) as exc:
                problem = str(exc)
            if cand.manifest.sharded:
                # Restoring shards is collective: every rank refuses a candidate any rank refused.
                verdicts = Comm().gather_objects(problem)
                problem = problem or next(
                    (f"refused on rank {r}: {p}" for r, p in enumerate(verdicts) if p), None
                )
            if read is None or problem is not None:
                message = f"{cand.path}: {problem}"
                refused.append(message)
                more = i + 1 < len(candidates)
                self._refuse(
                    message + ("; trying the next older checkpoint" if more else "; no older checkpoint left")
                )
                continue
            manifest, payload = read
            restore(cand, manifest, payload, model, optimizer)
            chosen = dataclasses.replace(cand, manifest=manifest)
            guard_state = payload.get("guard")
            if guard is not None:
                if isinstance(guard_state, dict):
                    guard.load_state_dict(guard_state)
                else:
                    warnings.warn(
                        f"{cand.path} holds no guard state (saved without guard=): the guard is "
                        f"left as it is; pass GuardConfig(start_step={chosen.step + 1})",
                        CheckpointWarning,
                        stacklevel=2,
                    )
            self.loaded = Loaded(
                checkpoint=chosen,
                extra=payload.get("extra"),
                refused=tuple(refused),
                guard_state=guard_state if isinstance(guard_state, dict) else None,
            )
            if retire_newer and Comm().rank == self.writer_rank:
                try:
                    self.retire_after(chosen.step)
                except OSError as exc:
                    # Only the writer rank retires: raising here would end that rank alone while
                    # the others go on (a hang). The restore itself succeeded on every rank.
                    log.warning("could not move newer checkpoints to %s/: %s", SUPERSEDED, exc)
                    warnings.warn(
                        f"could not move newer checkpoints to {SUPERSEDED}/: {exc}",
                        CheckpointWarning,
                        stacklevel=2,
                    )
            return chosen.step
        raise NoValidCheckpoint(
            f"no valid checkpoint at or before step {ckpt.step} in {self.directory}", refused
        )


def resume_point(
    directory: str | os.PathLike[str], incident: IncidentLike | None = None, policy: Policy = "last_pass"
) -> Checkpoint | None:
    """:meth:`CheckpointStore.resume_point` for a directory."""
    return CheckpointStore(directory).resume_point(incident, policy=policy)


def _write_all(fh: BinaryIO, data: bytes) -> None:
    fh.write(data)
