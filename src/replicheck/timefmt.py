"""Timestamps as both halves write them: ISO 8601 in UTC with an explicit offset (stdlib only)."""

from __future__ import annotations

import datetime as _dt
from typing import Literal

Precision = Literal["seconds", "microseconds"]


def utc_iso(t: _dt.datetime | None = None, *, timespec: Precision = "seconds") -> str:
    """``t`` (now when None) in UTC as ISO 8601 with ``+00:00``; a naive ``t`` is taken as local."""
    when = _dt.datetime.now(_dt.UTC) if t is None else t.astimezone(_dt.UTC)
    return when.isoformat(timespec=timespec)


def utc_iso_us(t: _dt.datetime | None = None) -> str:
    """As :func:`utc_iso` with microseconds: the controller's ordering of its own events needs them."""
    return utc_iso(t, timespec="microseconds")
