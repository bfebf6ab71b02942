"""The manifest: a small JSON file next to each checkpoint's payload that says what the payload
is and lets a reader verify it before trusting it. Standard library only.

The format is documented in ``docs/checkpoints.md``; a reader rejects any other format name or
version with :class:`ManifestError` and never guesses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from replicheck.checkpoint.errors import ManifestError
from replicheck.timefmt import utc_iso

FORMAT = "replicheck.checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PAYLOAD_NAME = "state.pt"
PAYLOAD_FORMAT = "replicheck.checkpoint.payload"
"""The ``format`` entry of a ``state.pt`` payload."""


def digest_hex(value: int) -> str:
    """A signed 64-bit digest as 16 lowercase hex digits (its unsigned bits)."""
    return f"{int(value) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What one checkpoint holds and how to verify it."""

    step: int
    """The step whose update the checkpoint holds (state after step ``step``)."""
    weights_digest: str
    """Exact fingerprint of the model parameters, in ``named_parameters()`` order: 16 hex digits
    of ``fingerprint.combine(fingerprint.digests(params))``."""
    optimizer_digest: str
    """Exact fingerprint of the optimizer's state tensors (per parameter index, keys sorted)."""
    last_verified_step: int | None
    """The guard's newest passing verification step when the checkpoint was saved (``None``:
    saved without a guard, or before any verification in this lineage)."""
    verify_every: int | None
    """The guard's verification period when saved (``None`` without a guard)."""
    payload: str = PAYLOAD_NAME
    """File name of the ``torch.save`` payload in the same directory."""
    payload_sha256: str
    """SHA-256 of the payload file (hex)."""
    payload_bytes: int
    """Size of the payload file in bytes."""
    num_params: int
    """Number of parameter tensors covered by ``weights_digest``."""
    world_size: int = 1
    """Ranks in the job that saved it."""
    replicas_checked: bool = False
    """True when the guard's cross-replica agreement check passed right before saving."""
    sharded: bool = False
    """True for a sharded model (FSDP2, HSDP): ``payload`` is a ``torch.distributed.checkpoint``
    directory, ``payload_sha256`` one SHA-256 over its files' names, SHA-256s and sizes, and the
    two digests combine every rank's shard digests in rank order (so it loads into the same world
    size and mesh only). Absent in older manifests: false."""
    time: str = field(default_factory=utc_iso)
    """When it was written, ISO 8601 with UTC offset."""
    format: str = FORMAT
    """Always ``replicheck.checkpoint``."""
    version: int = FORMAT_VERSION
    """Format version of this manifest."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, Mapping):
            raise ManifestError("a manifest must be a JSON object")
        if data.get("format") != FORMAT:
            raise ManifestError(
                f"not a replicheck checkpoint manifest (format={repr(data.get('format'))[:80]})"
            )
        if data.get("version") != FORMAT_VERSION:
            raise ManifestError(
                f"unsupported manifest version {repr(data.get('version'))[:80]}; this build reads version "
                f"{FORMAT_VERSION}"
            )
        return cls(
            step=_int(data, "step"),
            weights_digest=_hex(data, "weights_digest", 16),
            optimizer_digest=_hex(data, "optimizer_digest", 16),
            last_verified_step=_opt_int(data, "last_verified_step"),
            verify_every=_opt_int(data, "verify_every", minimum=1),
            payload=_name(data, "payload"),
            payload_sha256=_hex(data, "payload_sha256", 64),
            payload_bytes=_int(data, "payload_bytes"),
            num_params=_int(data, "num_params"),
            world_size=_int(data, "world_size", minimum=1),
            replicas_checked=_bool(data, "replicas_checked"),
            sharded=_bool(data, "sharded"),
            time=_str(data, "time"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except RecursionError as exc:
            raise ManifestError("manifest is nested too deeply to parse") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def _int(data: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ManifestError(f"manifest field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _opt_int(data: Mapping[str, Any], key: str, minimum: int = 0) -> int | None:
    return None if data.get(key) is None else _int(data, key, minimum)


def _str(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ManifestError(f"manifest field {key!r} must be a non-empty string")
    if not value.isprintable():
        # A NUL would otherwise surface later as a raw ValueError from the file system calls.
        raise ManifestError(f"manifest field {key!r} holds a control character (NUL, newline, ...)")
    return value


def _bool(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ManifestError(f"manifest field {key!r} must be true or false")
    return value


def _hex(data: Mapping[str, Any], key: str, length: int) -> str:
    value = _str(data, key)
    if len(value) != length or any(c not in "0123456789abcdef" for c in value):
        raise ManifestError(f"manifest field {key!r} must be {length} lowercase hex digits")
    return value


def _name(data: Mapping[str, Any], key: str) -> str:
    value = _str(data, key)
    if "/" in value or "\\" in value or value in (".", ".."):
        raise ManifestError(f"manifest field {key!r} must be a plain file name, got {value!r}")
    return value
