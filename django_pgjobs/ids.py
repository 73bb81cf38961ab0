"""Time-ordered job ids."""

from __future__ import annotations

import os
import time
import uuid


def uuid7(unix_seconds: float | None = None) -> uuid.UUID:
    """A UUID version 7 (RFC 9562): new rows land at the right edge of the primary key index.
    Made for now, or for the moment `unix_seconds` (e.g. tests of old jobs)."""
    now_ms = time.time_ns() // 1_000_000
    unix_ms = now_ms if unix_seconds is None else int(unix_seconds * 1000)
    value = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | int.from_bytes(os.urandom(10)) & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # RFC 4122 variant
    return uuid.UUID(int=value)


def uuid7_floor(unix_seconds: float) -> uuid.UUID:
    """The smallest UUIDv7 of that moment: every id made earlier (by a clock that agrees) sorts
    below it, in Python and in PostgreSQL's uuid order alike."""
    unix_ms = max(0, int(unix_seconds * 1000))
    value = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | 0x2 << 62
    return uuid.UUID(int=value)
