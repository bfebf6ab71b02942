"""Finding and parsing incident files. No store access: the controller decides what to keep.

Hostile directories are expected: symbolic links are never followed (a link is rejected
unread), a file that cannot be read yet is reported and retried, and no content ever makes
parsing raise anything but a rejection.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from replicheck.incident import Incident, IncidentFormatError, IncidentNotYetValidError

MAX_INCIDENT_BYTES = 4 * 1024 * 1024
"""Larger files are rejected unread (still kept as a head sample) rather than loaded whole."""


@dataclass(frozen=True)
class Candidate:
    """A file that may hold an incident, with the stat used to notice changes."""

    path: Path
    mtime_ns: int
    size: int
    symlink: bool = False
    """A symbolic link: rejected without following it."""


@dataclass(frozen=True)
class Parsed:
    """The result of reading one file: an incident, or the reason it was rejected."""

    source: str
    content: bytes
    incident: Incident | None = None
    error: str | None = None
    retry: bool = False
    """The file could not be read (yet): report it, and read it again on the next pass."""


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` as valid UTF-8 text: undecodable bytes of a file name become ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def scan(directory: str | os.PathLike[str]) -> Iterator[Candidate]:
    """``*.json`` entries of ``directory`` in name order; temporary files of writers are skipped.
    Symbolic links are reported (not followed); other non-regular files are ignored."""
    d = Path(directory)
    try:
        entries = sorted(os.scandir(d), key=lambda e: os.fsencode(e.name))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # vanished between listing and stat; the next pass sees the final state
        if stat.S_ISLNK(st.st_mode):
            yield Candidate(Path(entry.path), st.st_mtime_ns, st.st_size, symlink=True)
        elif stat.S_ISREG(st.st_mode):
            yield Candidate(Path(entry.path), st.st_mtime_ns, st.st_size)


def parse_file(path: str | os.PathLike[str]) -> Parsed:
    """Read and validate one incident file, never raising: a symbolic link is refused unread."""
    p = Path(path)
    source = display_path(os.path.abspath(p))
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Parsed(source, b"", error="symbolic link: not followed")
        return Parsed(source, b"", error=f"cannot read: {exc.strerror or exc}", retry=True)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Parsed(source, b"", error="not a regular file")
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            content = fh.read(MAX_INCIDENT_BYTES + 1)
    except OSError as exc:
        return Parsed(source, b"", error=f"cannot read: {exc.strerror or exc}", retry=True)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(content) > MAX_INCIDENT_BYTES:
        return Parsed(source, content[:65536], error=f"larger than {MAX_INCIDENT_BYTES} bytes")
    return parse_bytes(content, source)


def parse_bytes(content: bytes, source: str) -> Parsed:
    """Validate ``content``; any failure, expected or not, is a rejection with a reason."""
    try:
        return Parsed(source, content, incident=Incident.from_json(content))
    except IncidentNotYetValidError as exc:
        # A clock is wrong (the job's or ours): read it again on every pass until it is valid.
        return Parsed(source, content, error=str(exc), retry=True)
    except IncidentFormatError as exc:
        return Parsed(source, content, error=str(exc))
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, AttributeError) as exc:
        # A gap in validation must cost one input, never the ingestion loop.
        return Parsed(source, content, error=f"unreadable incident ({type(exc).__name__})")
