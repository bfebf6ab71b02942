"""Finding and parsing incident files. No store access: the controller decides what to keep."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from replicheck.incident import Incident, IncidentFormatError

MAX_INCIDENT_BYTES = 4 * 1024 * 1024
"""Larger files are rejected unread (still kept as a head sample) rather than loaded whole."""


@dataclass(frozen=True)
class Candidate:
    """A file that may hold an incident, with the stat used to notice changes."""

    path: Path
    mtime_ns: int
    size: int


@dataclass(frozen=True)
class Parsed:
    """The result of reading one file: an incident, or the reason it was rejected."""

    source: str
    content: bytes
    incident: Incident | None = None
    error: str | None = None


def scan(directory: str | os.PathLike[str]) -> Iterator[Candidate]:
    """``*.json`` files of ``directory`` in name order; temporary files of writers are skipped."""
    d = Path(directory)
    try:
        entries = sorted(os.scandir(d), key=lambda e: e.name)
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        try:
            if not entry.is_file():
                continue
            st = entry.stat()
        except OSError:
            continue  # vanished between listing and stat; the next pass sees the final state
        yield Candidate(Path(entry.path), st.st_mtime_ns, st.st_size)


def parse_file(path: str | os.PathLike[str]) -> Parsed:
    """Read and validate one incident file, never raising for bad content."""
    p = Path(path)
    source = str(p.resolve())
    try:
        with open(p, "rb") as fh:
            content = fh.read(MAX_INCIDENT_BYTES + 1)
    except OSError as exc:
        return Parsed(source, b"", error=f"cannot read: {exc.strerror or exc}")
    if len(content) > MAX_INCIDENT_BYTES:
        return Parsed(source, content[:65536], error=f"larger than {MAX_INCIDENT_BYTES} bytes")
    return parse_bytes(content, source)


def parse_bytes(content: bytes, source: str) -> Parsed:
    try:
        return Parsed(source, content, incident=Incident.from_json(content))
    except IncidentFormatError as exc:
        return Parsed(source, content, error=str(exc))
