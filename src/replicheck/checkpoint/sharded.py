"""Sharded checkpoints (FSDP2, HSDP): ``torch.distributed.checkpoint`` under the store's manifest.

Every rank writes its own shards (DCP) into the writer's staging directory; the writer then
hashes every file of the DCP directory into one tree SHA-256, records each rank's shard digests
(combined in rank order) in the manifest and commits the directory atomically, as for a DDP
checkpoint. A load verifies the tree hash on every rank before anything is restored, loads the
shards (DCP, collective) and digests the restored shards again. The shard digests depend on the
sharding, so a sharded checkpoint loads into the same world size and mesh only (DCP itself could
reshard; the verification could not).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from replicheck import fingerprint as fp
from replicheck.checkpoint import atomic
from replicheck.checkpoint.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointWriteError
from replicheck.checkpoint.manifest import Manifest, digest_hex
from replicheck.guard.shards import is_sharded, local, optimizer_digest
from replicheck.guard.transport.comm import Comm

DCP_DIR = "state.dcp"
"""The DCP directory (the manifest's ``payload``)."""
EXTRA_NAME = "extra.pt"
GUARD_NAME = "guard.pt"
"""The guard's own state (``Guard.state_dict()``) saved with a sharded checkpoint."""
"""The caller's ``extra``, saved by the writer next to the shards (covered by the tree hash)."""

__all__ = [
    "DCP_DIR",
    "EXTRA_NAME",
    "GUARD_NAME",
    "check_world",
    "digests",
    "is_sharded",
    "manifest_for",
    "read_extra",
    "restore",
    "tree_sha256",
    "stage",
    "verify",
]


def tree_sha256(root: Path) -> tuple[str, int]:
    """One SHA-256 over every file under ``root`` (each file's relative name, SHA-256 and size,
    sorted by name) and their total size."""
    if not root.is_dir():
        raise CheckpointCorrupt(f"{root.name} is missing or not a directory")
    lines, total = [], 0
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        sha, size = atomic.sha256_file(path)
        lines.append(f"{path.relative_to(root).as_posix()} {sha} {size}\n")
        total += size
    return hashlib.sha256("".join(lines).encode()).hexdigest(), total


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Comm) -> tuple[str, str, int]:
    """Collective: every rank's digest of its parameter shards and of its optimizer-state shards,
    combined in rank order; and the number of parameter tensors."""
    params = [local(p.detach()) for _, p in fp.named_weights(model, "all")]
    mine = (int(fp.weights_digest(params)), int(optimizer_digest(optimizer)))
    every = comm.gather_objects(mine)
    weights = fp.combine(torch.tensor([w for w, _ in every], dtype=torch.int64))
    opt = fp.combine(torch.tensor([o for _, o in every], dtype=torch.int64))
    return digest_hex(int(weights)), digest_hex(int(opt)), len(params)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def stage(
    final: Path,
    writer_rank: int,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Comm,
) -> tuple[Path, tuple[str, str, int]]:
    """Collective: the writer makes a staging directory for ``final``, every rank writes its
    shards into it (DCP); returns the staging directory and :func:`digests`."""
    import torch.distributed.checkpoint as dcp

    prepared: tuple[str | None, str] = (None, "")
    if comm.rank == writer_rank:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            atomic.clean_leftovers(final.parent)
            prepared = (str(atomic.staging_dir(final.parent, final.name)), "")
        except OSError as exc:
            prepared = (None, f"{type(exc).__name__}: {exc}")
    where, error = comm.gather_objects(prepared)[writer_rank]
    if where is None:
        raise CheckpointWriteError(
            f"rank {writer_rank} could not stage the checkpoint of step {step}: {error}"
        )
    staged = Path(where)
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=str(staged / DCP_DIR))
    except Exception as exc:  # noqa: BLE001 - DCP reports a failed write on every rank
        if comm.rank == writer_rank and staged.exists():
            atomic.remove_tree(staged)
        raise CheckpointWriteError(f"the shards of step {step} were not written: {exc}") from exc
    return staged, digests(model, optimizer, comm)


def manifest_for(staged: Path, fields: dict[str, Any]) -> Manifest:
    """The manifest of a staged sharded checkpoint (the writer hashes the shards every rank wrote)."""
    sha, size = tree_sha256(staged / DCP_DIR)
    return Manifest(payload=DCP_DIR, payload_sha256=sha, payload_bytes=size, sharded=True, **fields)


def check_world(path: Path, manifest: Manifest, comm: Comm) -> None:
    """Refuse a sharded checkpoint saved by another number of ranks (its digests are per shard)."""
    if manifest.world_size != comm.world_size:
        raise CheckpointMismatch(
            f"{path}: saved sharded over {manifest.world_size} ranks, this job has {comm.world_size} "
            "(a sharded checkpoint loads into the same world size and mesh)"
        )


def verify(path: Path, manifest: Manifest) -> None:
    """Refuse a sharded checkpoint whose shard files changed on disk."""
    sha, size = tree_sha256(path / manifest.payload)
    if size != manifest.payload_bytes:
        raise CheckpointCorrupt(f"shards total {size} bytes, the manifest says {manifest.payload_bytes}")
    if sha != manifest.payload_sha256:
        raise CheckpointCorrupt("shard files' SHA-256 does not match the manifest (bytes changed on disk)")


def read_extra(path: Path, name: str = EXTRA_NAME) -> Any:
    """The caller's ``extra`` (or with ``name=GUARD_NAME`` the guard's state) saved with a
    sharded checkpoint (``None`` when there was none)."""
    file = path / name
    if not file.exists():
        return None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointCorrupt(f"{name} does not load: {type(exc).__name__}") from None


def restore(
    path: Path,
    manifest: Manifest,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    comm: Comm,
) -> None:
    """Collective: load the shards into ``model`` (and ``optimizer``) and check their digests."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if optimizer is None:
        raise CheckpointMismatch(f"{path}: a sharded checkpoint is restored with its optimizer (pass it)")
    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path / manifest.payload))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as exc:  # noqa: BLE001 - a checkpoint that does not fit the model
        raise CheckpointMismatch(f"{path}: the shards do not fit the model: {str(exc)[:300]}") from None
    weights, opt, _ = digests(model, optimizer, comm)
    if weights != manifest.weights_digest or opt != manifest.optimizer_digest:
        raise CheckpointMismatch(
            f"{path}: restored shards fingerprint to {weights}/{opt}, the manifest says "
            f"{manifest.weights_digest}/{manifest.optimizer_digest} (another mesh or dtype changes them)"
        )
