"""Reading a checkpoint back: every check before anything is restored, then the restore into a
live model and optimizer (the checks that it fits, the fingerprint after)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from replicheck import fingerprint as fp
from replicheck.checkpoint import sharded
from replicheck.checkpoint.errors import CheckpointCorrupt, CheckpointMismatch
from replicheck.checkpoint.manifest import PAYLOAD_FORMAT, Manifest, digest_hex
from replicheck.checkpoint.record import Checkpoint
from replicheck.guard.modules import unwrap
from replicheck.guard.transport.comm import Comm


def restore(
    ckpt: Checkpoint,
    manifest: Manifest,
    payload: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Restore a verified checkpoint's state into ``model`` (and ``optimizer``), checking that it
    fits first and that the restored weights fingerprint as the manifest says."""
    bare = unwrap(model)
    if manifest.sharded:
        sharded.restore(ckpt.path, manifest, bare, optimizer, Comm())
        return
    own = bare.state_dict()
    state = payload["model"]
    if set(own) != set(state):
        extra_keys, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
        raise CheckpointMismatch(
            f"{ckpt.path}: state keys differ from the model (missing {missing[:3]}, unexpected {extra_keys[:3]})"
        )
    for key, value in own.items():
        theirs = state[key]
        if isinstance(value, torch.Tensor) and (
            not isinstance(theirs, torch.Tensor) or theirs.shape != value.shape
        ):
            raise CheckpointMismatch(
                f"{ckpt.path}: {key} has shape {getattr(theirs, 'shape', None)}, "
                f"the model {tuple(value.shape)}"
            )
    if optimizer is not None:
        groups, saved = optimizer.param_groups, payload["optimizer"].get("param_groups")
        if (
            not isinstance(saved, list)
            or len(saved) != len(groups)
            or any(
                not isinstance(s, Mapping) or len(s.get("params", ())) != len(g["params"])
                for s, g in zip(saved, groups)
            )
        ):
            raise CheckpointMismatch(f"{ckpt.path}: optimizer parameter groups do not match the optimizer")
    bare.load_state_dict(state)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointMismatch(f"{ckpt.path}: optimizer state does not fit: {exc}") from None
    restored = digest_hex(fp.model_digest(bare, "all"))
    if restored != manifest.weights_digest:
        raise CheckpointMismatch(
            f"{ckpt.path}: weights after restoring fingerprint to {restored}, the manifest says "
            f"{manifest.weights_digest} (the model's dtype or device changes the values)"
        )


def read_verified(
    ckpt: Checkpoint,
    model: torch.nn.Module,
    *,
    read_manifest: Callable[[Path], Manifest],
    check_payload: Callable[[Path, Manifest], Path],
) -> tuple[Manifest, dict[str, Any]]:
    """Manifest, checksum, structure and fingerprints, all before anything is restored."""
    if not ckpt.path.is_dir():
        raise CheckpointCorrupt("directory is missing")
    manifest = read_manifest(ckpt.path)
    if manifest.step != ckpt.step:
        raise CheckpointCorrupt(f"manifest now says step {manifest.step}, expected {ckpt.step}")
    if manifest.sharded != sharded.is_sharded(unwrap(model)):
        kind = "a sharded (FSDP2/HSDP)" if manifest.sharded else "an unsharded"
        raise CheckpointMismatch(f"{ckpt.path}: {kind} checkpoint does not load into this model")
    if manifest.sharded:
        sharded.check_world(ckpt.path, manifest, Comm())
        check_payload(ckpt.path, manifest)
        return manifest, {
            "extra": sharded.read_extra(ckpt.path),
            "guard": sharded.read_extra(ckpt.path, sharded.GUARD_NAME),
        }
    payload_path = check_payload(ckpt.path, manifest)
    try:
        payload = torch.load(payload_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad payload
        raise CheckpointCorrupt(f"payload does not load: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
        raise CheckpointCorrupt("payload is not a replicheck checkpoint payload")
    if payload.get("step") != manifest.step:
        raise CheckpointCorrupt(
            f"payload holds step {payload.get('step')!r}, the manifest says {manifest.step}"
        )
    state, opt = payload.get("model"), payload.get("optimizer")
    if (
        not isinstance(state, Mapping)
        or not isinstance(opt, Mapping)
        or not isinstance(opt.get("state"), Mapping)
    ):
        raise CheckpointCorrupt("payload lacks the model or optimizer state")
    names = [n for n, _ in fp.named_weights(unwrap(model), "all")]
    missing = [n for n in names if not isinstance(state.get(n), torch.Tensor)]
    if missing:
        raise CheckpointMismatch(
            f"{ckpt.path}: the model's parameters {missing[:3]} are not in the checkpoint"
        )
    if len(names) != manifest.num_params:
        raise CheckpointMismatch(
            f"{ckpt.path}: the model has {len(names)} parameter tensors, the checkpoint {manifest.num_params}"
        )
    if digest_hex(fp.weights_digest(state[n] for n in names)) != manifest.weights_digest:
        raise CheckpointCorrupt("weight fingerprint does not match the manifest")
    if digest_hex(fp.optimizer_digest(opt["state"])) != manifest.optimizer_digest:
        raise CheckpointCorrupt("optimizer-state fingerprint does not match the manifest")
    return manifest, payload
