"""Crash-safe file system steps: build a checkpoint in a hidden staging directory, fsync every
file and the directory, then publish it with one ``rename``.

A crash before :func:`commit` leaves only a ``.tmp-*`` directory, which readers never look at
and the next writer removes; a crash after it leaves a complete checkpoint. Readers therefore
see either the whole checkpoint or none of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_CHUNK = 1 << 20


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(root: Path, name: str) -> Path:
    """A fresh hidden directory in ``root`` to build ``name`` in."""
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=root))


def write_file(path: Path, writer: Callable[[BinaryIO], None]) -> None:
    """Create ``path``, let ``writer`` fill it, then flush and fsync it."""
    with open(path, "xb") as fh:
        writer(fh)
        fh.flush()
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> tuple[str, int]:
    """SHA-256 (hex) and size of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def commit(staged: Path, final: Path) -> None:
    """Publish a fully written staging directory as ``final`` (which must not exist)."""
    fsync_dir(staged)
    os.rename(staged, final)
    fsync_dir(final.parent)


def move_aside(path: Path, into: Path) -> Path:
    """Rename ``path`` into directory ``into`` under a name not yet taken there; return it."""
    into.mkdir(parents=True, exist_ok=True)
    target = into / path.name
    n = 1
    while target.exists():
        target = into / f"{path.name}.{n}"
        n += 1
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted checkpoint is ever visible under its name:
    it is renamed to a hidden trash name first."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(root: Path) -> list[Path]:
    """Remove staging and trash directories left by crashed writers; return what was removed.

    Only the single writer of a store may call this (a concurrent writer's staging directory
    would be removed too).
    """
    removed = []
    for entry in root.iterdir():
        if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
